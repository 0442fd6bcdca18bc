"""`mira eval ppl` end to end on a tiny checkpoint, against transformers' own forward; its one-line errors."""

import json
import math
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mira.cli import main
from mira.eval.ppl import windows
from mira.runtime.engine import BUNDLED_MODEL
from tiny_models import TEXT


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "text.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(TEXT[i:i + 8])}) + "\n" for i in range(0, 40, 8)))
    return path


def _transformers_nll(checkpoint, ids, context, stride):
    """Mean NLL of the same windows through transformers' own model (float32, its own experts)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for w in windows(len(ids), context, stride):
            log_probs = torch.log_softmax(model(ids[None, w.begin:w.end]).logits[0].double(), dim=-1)
            for t in range(w.first_scored, w.end):
                total -= log_probs[t - w.begin - 1, ids[t]].item()
    return total / (len(ids) - 1)


def test_ppl_reference_matches_transformers_and_int8_stays_close(int4_checkpoints, text_file, tmp_path, capsys):
    checkpoint = int4_checkpoints["mixtral"]  # every scheme, int4's whole tiles included
    out = tmp_path / "eval.json"
    argv = ["eval", "ppl", "--model", str(checkpoint), "--data", str(text_file), "--context", "32", "--stride", "12",
            "--max-tokens", "150", "--device", "cpu", "--quiet", "--json", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == result
    assert result["tokens"] == 150 and result["scored_tokens"] == 149 and result["windows"] == len(windows(150, 32, 12))
    assert list(result["schemes"]) == ["none", "int8-shared", "int8-row", "int4"]

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    lines = [json.loads(line)["text"] for line in text_file.read_text().splitlines()]
    ids = torch.tensor([i for line in lines for i in tokenizer(line).input_ids][:150])
    expected = _transformers_nll(checkpoint, ids, 32, 12)
    none = result["schemes"]["none"]
    assert none["nll_per_token"] == pytest.approx(expected, abs=1e-4)
    assert none["perplexity"] == pytest.approx(math.exp(expected), rel=1e-4)
    for scheme in ("int8-shared", "int8-row"):
        figures = result["schemes"][scheme]
        assert 0 < figures["mean_kl"] < 0.01 and figures["mean_kl"] <= figures["max_kl"]
        assert abs(figures["perplexity_change"]) < 0.02
        assert figures["top1_agreement"] >= 0.9  # a random model's near-flat distributions flip some top-1 ties
        assert figures["perplexity_change"] == pytest.approx(figures["perplexity"] / none["perplexity"] - 1)
    # int4: 16 levels instead of 255, further from the reference, still close (its top-1 agreement is
    # near chance on this random model's flat distributions, so it is not checked here)
    four = result["schemes"]["int4"]
    assert result["schemes"]["int8-row"]["mean_kl"] < four["mean_kl"] < 0.02 and four["mean_kl"] <= four["max_kl"]
    assert abs(four["perplexity_change"]) < 0.02


def test_ppl_table_and_scheme_subset(checkpoints, text_file, capsys):
    argv = ["eval", "ppl", "--model", str(checkpoints["mixtral"]), "--data", str(text_file), "--context", "24",
            "--max-tokens", "60", "--quant", "int8-row", "--device", "cpu", "--quiet"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "| none (reference) |" in table and "| int8-row |" in table and "int8-shared" not in table
    assert "59 tokens of text.jsonl scored in 4 windows of 24 (stride 12)" in table


def test_ppl_defaults_fit_the_checkpoint_and_the_text_and_a_budget_changes_no_figure(checkpoints, text_file, capsys):
    """Experts int4 cannot tile are scored in every other scheme, with a note; a text shorter than the
    default context is one window of its length; a budget of a share of the experts gives the figures
    of every expert in place."""
    common = ["eval", "ppl", "--model", str(checkpoints["mixtral"]), "--data", str(text_file), "--max-tokens", "40",
              "--device", "cpu", "--quiet", "--json"]
    assert main(common) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert list(result["schemes"]) == ["none", "int8-shared", "int8-row"]
    assert "mira: leaving out int4: int4 stores tiles of 64 rows" in err
    assert (result["context"], result["stride"], result["windows"], result["scored_tokens"]) == (40, 20, 1, 39)
    assert main(common + ["--vram-budget", "50%"]) == 0
    budgeted = json.loads(capsys.readouterr().out)
    for scheme, figures in result["schemes"].items():
        assert budgeted["schemes"][scheme] == pytest.approx(figures, rel=1e-5, abs=1e-7)


def test_ppl_refuses_a_tokenizer_beyond_the_embeddings(checkpoints, text_file, tmp_path, capsys):
    checkpoint = shutil.copytree(checkpoints["mixtral"], tmp_path / "mixtral")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer of 50 times the vocabulary
        shutil.copy(BUNDLED_MODEL / name, checkpoint / name)
    argv = ["eval", "ppl", "--model", str(checkpoint), "--data", str(text_file), "--quant", "int8-shared",
            "--device", "cpu", "--quiet"]
    assert main(argv) == 1
    assert re.search(r"mira: error: the tokenizer of \S+ gives token id \d+, beyond the model's 320 embeddings: its "
                     r"tokenizer files are another model's", capsys.readouterr().err)


@pytest.mark.parametrize("setup,extra,message", [
    ("missing", [], r"data file \S+nowhere.txt does not exist; pass --data with a .txt or .jsonl file"),
    ("empty", [], r"data file \S+empty.txt holds no text; pass a file with some"),
    ("blank-jsonl", [], r"data file \S+blank.jsonl holds no text"),
    ("bad-jsonl", [], r"bad.jsonl line 2 has no \"text\" string; give every line one"),
    ("short", ["--context", "64"], r"the text has \d+ tokens, fewer than one window of 64; pass a longer text or a "
                                   r"smaller --context"),
    ("short", ["--quant", "int8-shared,int3"], r"unknown quantization scheme int3; choose from int8-shared, int8-row, "
                                               r"int4, none"),
    ("short", ["--context", "8", "--stride", "8"], r"--stride 8 must be at least 1 and less than the context of 8"),
])
def test_ppl_bad_input_gets_one_line(int4_checkpoints, tmp_path, capsys, setup, extra, message):
    files = {"missing": tmp_path / "nowhere.txt", "empty": tmp_path / "empty.txt", "blank-jsonl": tmp_path / "blank.jsonl",
             "bad-jsonl": tmp_path / "bad.jsonl", "short": tmp_path / "short.txt"}
    files["empty"].write_text("  \n")
    files["blank-jsonl"].write_text('{"text": ""}\n\n{"text": " "}\n')
    files["bad-jsonl"].write_text('{"text": "fine"}\n{"prompt": "no text"}\n')
    files["short"].write_text("the quick brown fox jumps over the lazy dog")
    argv = ["eval", "ppl", "--model", str(int4_checkpoints["mixtral"]), "--data", str(files[setup]), "--device", "cpu",
            "--quiet", *extra]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mira: error: ")
    assert len([line for line in err if line.startswith("mira: error")]) == 1
    assert re.search(message, err[-1]), err[-1]


def test_ppl_refuses_a_store(stores, capsys):
    assert main(["eval", "ppl", "--model", str(stores["mixtral", "int8-shared"]), "--quiet"]) == 1
    assert "is a store of one scheme; mira eval ppl compares schemes of one checkpoint, so pass --model with the " \
           "Hugging Face model directory" in capsys.readouterr().err
