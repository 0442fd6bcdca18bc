"""`mira eval`: what quantizing the experts costs in quality (paper Table I, Table II, VI-B).

data.py reads the text, ppl.py measures perplexity, KL divergence and top-1 agreement of each
expert scheme against the unquantized experts, command.py is the CLI, and lm_eval_backend.py runs
lm-evaluation-harness tasks through Mira's runtime.
"""
