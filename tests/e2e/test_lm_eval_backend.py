"""The lm-eval backend `mira`: its requests against transformers' own model, and the committed local
BIG-bench tasks run through lm-eval's Python API with no network."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import lm_eval  # in the test extra
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from mira.cli import main
from mira.errors import MiraError
from mira.eval.command import harness_argv
from mira.eval.lm_eval_backend import MiraLM
from mira.runtime.engine import BUNDLED_MODEL

TASKS = Path(__file__).resolve().parent.parent / "lm_eval_tasks"


def _instance(kind: str, arguments: tuple) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=arguments, idx=0)


@pytest.fixture(scope="module")
def tiny(checkpoints):
    checkpoint = checkpoints["mixtral"]
    lm = MiraLM(pretrained=str(checkpoint), quant="none", device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return lm, reference, AutoTokenizer.from_pretrained(checkpoint)


def _sum_log_probs(model, ids: list[int], first: int) -> float:
    """sum over t >= first of log p(ids[t] | ids[:t]), float64, one forward of transformers' model."""
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    return sum(log_probs[t - 1, ids[t]].item() for t in range(first, len(ids)))


def test_loglikelihood_matches_transformers(tiny):
    lm, reference, tokenizer = tiny
    pairs = [("the quick brown", " fox jumps"), ("hello world,", " this is"), ("", "mixture of experts")]
    results = lm.loglikelihood([_instance("loglikelihood", pair) for pair in pairs], disable_tqdm=True)
    for (context, continuation), (total, _) in zip(pairs, results):
        if context:
            whole = tokenizer(context + continuation).input_ids
            first = len(tokenizer(context).input_ids)
        else:  # an empty context is the prefix token (the tokenizer has no BOS: its EOS)
            whole = [tokenizer.eos_token_id, *tokenizer(continuation).input_ids]
            first = 1
        assert total == pytest.approx(_sum_log_probs(reference, whole, first), abs=1e-3)


def test_is_greedy_is_true_for_the_models_own_argmax(tiny):
    lm, reference, tokenizer = tiny
    context = tokenizer("the quick brown fox").input_ids
    with torch.no_grad():
        nxt = int(reference(torch.tensor([context])).logits[0, -1].argmax())
    (_, greedy), = lm._loglikelihood_tokens([(("", ""), context, [nxt])], disable_tqdm=True)
    (_, not_greedy), = lm._loglikelihood_tokens([(("", ""), context, [(nxt + 1) % 320])], disable_tqdm=True)
    assert greedy and not not_greedy


def test_loglikelihood_rolling_matches_one_forward_over_the_whole_string(tiny):
    lm, reference, tokenizer = tiny
    text = "def sort(xs): return sorted(xs) and the quick brown fox jumps over the lazy dog " * 3
    ids = [tokenizer.eos_token_id, *tokenizer(text).input_ids]
    assert len(ids) < 256  # one forward of transformers' model sees it all (max_position_embeddings 256)
    lm.max_length = 40  # so that Mira's side runs several windows
    try:
        (total,) = lm.loglikelihood_rolling([_instance("loglikelihood_rolling", (text,))], disable_tqdm=True)
    finally:
        lm.max_length = lm.model.max_context
    # windows of 40 tokens see less context than one forward, so the sums differ a little; the first
    # window's tokens see the same context and must agree exactly
    (first_window,) = lm.loglikelihood_rolling([_instance("loglikelihood_rolling", (text[:60],))],
                                               disable_tqdm=True)
    short = [tokenizer.eos_token_id, *tokenizer(text[:60]).input_ids]
    assert first_window == pytest.approx(_sum_log_probs(reference, short, 1), abs=1e-3)
    assert total == pytest.approx(_sum_log_probs(reference, ids, 1), rel=0.05)


def test_generate_until_is_transformers_greedy_cut_at_the_stop_string(tiny):
    lm, reference, tokenizer = tiny
    context = "the quick brown fox"
    ids = tokenizer(context, return_tensors="pt").input_ids
    with torch.no_grad():
        out = reference.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    stop = expected[len(expected) // 2:][:2]
    (free,) = lm.generate_until([_instance("generate_until", (context, {"max_gen_toks": 12, "until": []}))],
                                disable_tqdm=True)
    (cut,) = lm.generate_until([_instance("generate_until", (context, {"max_gen_toks": 12, "until": [stop]}))],
                               disable_tqdm=True)
    assert free == expected
    assert cut == expected.split(stop)[0] and len(cut) < len(expected)
    (zero,) = lm.generate_until([_instance("generate_until", (context, {"max_gen_toks": 12, "until": [],
                                                                         "do_sample": True, "temperature": 0.0}))],
                                disable_tqdm=True)
    assert zero == expected  # a temperature of 0 decodes greedily, sampling asked for or not


@pytest.mark.parametrize("settings, says", [
    ({"max_gen_toks": 4, "num_beams": 4}, "does not take the generation setting num_beams"),
    ({"max_gen_toks": 10_000}, "asks for 10000 new tokens"),
])
def test_generate_until_refuses_what_it_would_not_carry_out(tiny, settings, says):
    lm, _, _ = tiny
    with pytest.raises(MiraError, match=says):
        lm.generate_until([_instance("generate_until", ("the quick brown fox", settings))], disable_tqdm=True)


def test_model_args_it_does_not_take_are_named_and_a_share_budget_is_taken(checkpoints):
    with pytest.raises(MiraError, match="takes no --model_args bogus"):
        MiraLM(pretrained=str(checkpoints["mixtral"]), device="cpu", bogus=1)
    with pytest.raises(MiraError, match=r"/no/such/model does not exist; pass .*lm-eval's pretrained=\) with"):
        MiraLM(pretrained="/no/such/model", device="cpu")
    with pytest.raises(MiraError, match=r"^policy='lru' has no effect on the CPU without vram_budget"):
        MiraLM(pretrained=str(checkpoints["mixtral"]), device="cpu", policy="lru")
    lm = MiraLM(pretrained=str(checkpoints["mixtral"]), quant="int8-row", device="cpu", vram_budget="50%",
                policy="lru")
    assert lm.model.stats()["slots"] == round(0.5 * lm.model.stats()["total_experts"])


@pytest.fixture(scope="module")
def bundled_tokenizer():
    return AutoTokenizer.from_pretrained(BUNDLED_MODEL)


def test_local_bigbench_tasks_per_scheme_match_transformers(bundled_tokenizer):
    """The committed BIG-bench tasks through lm-eval's own evaluator, for two schemes: the unquantized
    experts give transformers' log-likelihoods; int8-shared stays close to them."""
    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    tasks = ["mira_bigbench_anachronisms", "mira_bigbench_general_knowledge"]
    results = {}
    for scheme in ("none", "int8-shared"):
        results[scheme] = lm_eval.simple_evaluate(model="mira", model_args={"quant": scheme}, device="cpu",
                                                  tasks=tasks, task_manager=manager, limit=6, log_samples=True)
    reference = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()
    for task in tasks:
        samples = {scheme: results[scheme]["samples"][task] for scheme in results}
        assert len(samples["none"]) == 6
        gaps = []
        for plain, quantized in zip(samples["none"], samples["int8-shared"]):
            assert quantized["arguments"] == plain["arguments"]
            for (context, continuation), [(total, _)], [(quantized_total, _)] in zip(
                    plain["arguments"], plain["resps"], quantized["resps"]):
                # the harness scores the context's trailing whitespace as part of the continuation
                whole = bundled_tokenizer(context + continuation).input_ids
                first = len(bundled_tokenizer(context.rstrip()).input_ids)
                assert total == pytest.approx(_sum_log_probs(reference, whole, first), abs=1e-3)
                gaps.append(abs(quantized_total - total))
        assert 0 < max(gaps) < 0.5
        for scheme in results:
            accuracy = results[scheme]["results"][task]["acc,none"]
            golds = [sample["target"] for sample in samples[scheme]]
            picks = [max(range(len(s["resps"])), key=lambda i, s=s: s["resps"][i][0][0]) for s in samples[scheme]]
            assert accuracy == pytest.approx(sum(p == g for p, g in zip(picks, golds)) / len(golds))


def test_mira_eval_lm_eval_hands_its_arguments_to_the_harness_command_line(capsys):
    argv = sys.argv
    assert main(["eval", "lm-eval", "--model", "mira", "--model_args", "quant=int8-row",  # the device Mira picks
                 "--include_path", str(TASKS), "--tasks", "mira_bigbench_cause_and_effect_one_sentence",
                 "--limit", "3"]) == 0
    assert sys.argv is argv
    table = capsys.readouterr().out
    assert "mira_bigbench_cause_and_effect_one_sentence" in table and "acc" in table and "mira ({'quant': 'int8-row'})" in table


def test_a_run_that_names_no_device_gets_the_one_mira_picks_not_the_harness_cuda_0():
    run = ["--model", "mira", "--tasks", "hellaswag"]
    assert harness_argv(run, cuda=False) == [*run, "--device", "cpu"]
    assert harness_argv(["run", *run], cuda=True) == ["run", *run, "--device", "cuda"]
    for named in (["--device", "cuda:1"], ["--device=cpu"]):
        assert harness_argv([*run, *named], cuda=False) == [*run, *named]
    for other in ([], ["ls", "tasks"], ["validate", "--tasks", "hellaswag"], ["run", "--help"]):
        assert harness_argv(other, cuda=False) == other  # no run, or one that only shows its help
    for named in (["--model_args", "quant=int4,device=cpu"], ["--model_args=device=cuda:0"]):
        assert harness_argv([*run, *named], cuda=True) == [*run, *named]  # the model's own device


def test_a_device_in_the_model_args_and_on_the_command_line_is_one_setting():
    model_args = f"pretrained={BUNDLED_MODEL},device=cpu"
    model = MiraLM.create_from_arg_string(model_args, {"device": "cpu", "batch_size": 1, "max_batch_size": None})
    assert model.model.device.type == "cpu"
    with pytest.raises(MiraError, match=r"device is given twice, cpu in --model_args and cuda on the command line"):
        MiraLM.create_from_arg_string(model_args, {"device": "cuda"})


def test_a_task_whose_data_cannot_be_fetched_is_named_not_reported_as_a_fault(monkeypatch, capsys):
    from lm_eval._cli import HarnessCLI

    def offline(self, args):  # what the datasets library raises without the network or a cached copy
        raise ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(HarnessCLI, "execute", offline)
    assert main(["eval", "lm-eval", "--model", "mira", "--tasks", "hellaswag"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("mira: error: lm-evaluation-harness could not fetch a task's data (Couldn't reach "
                            "'Rowan/hellaswag'") and "--include_path" in error and "internal error" not in error


def test_mira_eval_lm_eval_names_a_task_the_harness_does_not_know(capsys):
    argv = sys.argv
    assert main(["eval", "lm-eval", "--model", "mira", "--tasks", "no_such_task_here"]) == 1
    assert sys.argv is argv
    error = capsys.readouterr().err
    assert error.startswith("mira: error: lm-evaluation-harness refused the run: Tasks not found: no_such_task_here")
    assert "`mira eval lm-eval ls tasks`" in error and error.count("\n") == 1
