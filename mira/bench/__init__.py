"""`mira bench`: end-to-end timings at several VRAM budgets, against baselines and the bound (paper V, VI).

Modules: synthetic (random models at real shapes), sources (what is benchmarked), prompts (the
prompt sets), measure (timing one configuration), bound (DESIGN.md 4), hf (the transformers
baselines), run (the order of a whole run), report (table and charts), command (the CLI).
"""
