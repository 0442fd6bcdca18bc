"""mira.eval.ppl: windows score every token once; the totals match a float64 computation by hand."""

import math

import pytest
import torch

from mira.errors import MiraError
from mira.eval.ppl import REFERENCE, SchemeTotals, Window, measure, windows


def test_windows_hand_worked():
    assert windows(10, 4, 2) == [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]
    # the last window is moved back to end at the stream's end, scoring only what is left
    assert windows(9, 4, 3) == [Window(0, 4, 1), Window(3, 7, 4), Window(5, 9, 7)]
    assert windows(4, 4, 2) == [Window(0, 4, 1)]


@pytest.mark.parametrize("num_tokens", [5, 17, 64, 100])
@pytest.mark.parametrize("context,stride", [(5, 1), (5, 4), (8, 3), (16, 8)])
def test_windows_score_each_token_but_the_first_once(num_tokens, context, stride):
    if num_tokens < context:
        return
    scored = [t for w in windows(num_tokens, context, stride) for t in range(w.first_scored, w.end)]
    assert scored == list(range(1, num_tokens))
    for w in windows(num_tokens, context, stride):
        assert w.end - w.begin == context and w.begin < w.first_scored <= w.end


def test_window_errors_name_the_fix():
    with pytest.raises(MiraError, match="fewer than one window of 8; pass a longer text or a smaller --context"):
        windows(7, 8, 4)
    with pytest.raises(MiraError, match="--stride 0 must be at least 1 and less than the context of 8"):
        windows(20, 8, 0)
    with pytest.raises(MiraError, match="--stride 8 must be"):
        windows(20, 8, 8)
    with pytest.raises(MiraError, match="--context 1 leaves nothing"):
        windows(20, 1, 1)


def _float64_figures(log_probs, reference, targets):
    """Per-token NLL, KL(reference || scheme) and agreement, summed element by element in float64."""
    nll = kl = 0.0
    kls, agree = [], 0
    for t in range(len(targets)):
        p, q = reference[t].double().tolist(), log_probs[t].double().tolist()
        nll -= q[targets[t]]
        token_kl = sum(math.exp(a) * (a - b) for a, b in zip(p, q))
        kl += token_kl
        kls.append(token_kl)
        agree += max(range(len(p)), key=p.__getitem__) == max(range(len(q)), key=q.__getitem__)
    return nll, kl, max(kls), agree


def test_totals_match_float64():
    generator = torch.Generator().manual_seed(0)
    totals = SchemeTotals()
    expected = [0.0, 0.0, 0.0, 0]
    for _ in range(3):  # three windows
        reference = torch.log_softmax(torch.randn(7, 11, generator=generator) * 3, dim=-1)
        log_probs = torch.log_softmax(reference + 0.3 * torch.randn(7, 11, generator=generator), dim=-1)
        targets = torch.randint(0, 11, (7,), generator=generator)
        totals.add(log_probs, targets, reference)
        nll, kl, max_kl, agree = _float64_figures(log_probs, reference, targets)
        expected = [expected[0] + nll, expected[1] + kl, max(expected[2], max_kl), expected[3] + agree]
    assert totals.tokens == 21
    assert totals.nll == pytest.approx(expected[0], rel=1e-6)
    assert totals.kl == pytest.approx(expected[1], rel=1e-5)
    assert totals.max_kl == pytest.approx(expected[2], rel=1e-5)
    assert totals.top1_agree == expected[3] and 0 < expected[3] < 21


def test_reference_against_itself_is_zero_kl_and_full_agreement():
    reference = torch.log_softmax(torch.randn(5, 9), dim=-1)
    totals = SchemeTotals()
    totals.add(reference, torch.arange(5), reference)
    assert totals.kl == 0.0 and totals.max_kl == 0.0 and totals.top1_agree == 5


def _bigram(table: torch.Tensor):
    """A model whose next-token distribution depends on the current token only: log_softmax(table[id])."""
    calls = []

    def forward(ids: torch.Tensor) -> torch.Tensor:
        calls.append(len(ids))
        return torch.log_softmax(table[ids], dim=-1)

    forward.calls = calls
    return forward


def test_measure_over_windows_equals_the_whole_stream_for_a_context_free_model():
    """A bigram model's windowed figures must equal those of one pass over the whole stream in float64."""
    generator = torch.Generator().manual_seed(1)
    vocab = 13
    reference_table = torch.randn(vocab, vocab, generator=generator) * 2
    scheme_table = reference_table + 0.2 * torch.randn(vocab, vocab, generator=generator)
    ids = torch.randint(0, vocab, (101,), generator=generator)
    reference, scheme = _bigram(reference_table), _bigram(scheme_table)
    spans = windows(len(ids), 16, 5)

    figures = measure({"int8-row": scheme, REFERENCE: reference}, ids, spans, progress=False)

    assert list(figures) == [REFERENCE, "int8-row"]
    assert len(reference.calls) == len(scheme.calls) == len(spans)  # one forward per window and scheme
    ref_lp = torch.log_softmax(reference_table[ids[:-1]].double(), dim=-1)  # [N-1, V]
    lp = torch.log_softmax(scheme_table[ids[:-1]].double(), dim=-1)
    targets = ids[1:]
    nll, kl, max_kl, agree = _float64_figures(lp, ref_lp, targets)
    ref_nll = -sum(ref_lp[t, targets[t]].item() for t in range(len(targets)))
    n = len(targets)
    assert figures[REFERENCE] == {"perplexity": pytest.approx(math.exp(ref_nll / n), rel=1e-6),
                                  "nll_per_token": pytest.approx(ref_nll / n, rel=1e-6)}
    assert figures["int8-row"]["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-6)
    assert figures["int8-row"]["perplexity_change"] == pytest.approx(math.exp((nll - ref_nll) / n) - 1, abs=1e-6)
    assert figures["int8-row"]["mean_kl"] == pytest.approx(kl / n, rel=1e-5)
    assert figures["int8-row"]["max_kl"] == pytest.approx(max_kl, rel=1e-5)
    assert figures["int8-row"]["top1_agreement"] == pytest.approx(agree / n)
    assert 0 < agree < n
