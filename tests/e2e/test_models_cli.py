"""`mira models`: the MoE families of the installed transformers and whether Mira runs them."""

import json

import pytest

from mira.cli import main
from mira.models.interface import moe_families


def test_mira_models_lists_every_interface_family_with_what_mira_does(capsys):
    main(["models", "--json"])
    listed = {row["model_type"]: row for row in json.loads(capsys.readouterr().out)["families"]}
    assert set(listed) == {family.model_type for family in moe_families()}
    assert listed["mixtral"]["runs"] is True and listed["mixtral"]["kernels"] == "fused"
    assert listed["gpt_oss"]["runs"] is True and listed["gpt_oss"]["kernels"] == "fused"  # biases, clamped SwiGLU
    assert listed["nemotron_h"]["kernels"] == "fused"  # ungated experts, the squared ReLU
    if "gemma4_text" in listed:  # GeGLU with the tanh GELU
        assert listed["gemma4_text"]["kernels"] == "fused"
    if "inkling2_text" in listed:  # a SwiGLU whose linear gate factor and up are softcapped
        assert listed["inkling2_text"]["kernels"] == "fused"
    if "bailing_hybrid" in listed:  # its Experts take the layer index (a clamp per layer)
        assert listed["bailing_hybrid"]["runs"] is True
    for dense_default in ("gemma4_text", "dots1"):  # built with experts on and their counts filled in
        if dense_default in listed:
            assert listed[dense_default]["runs"] is True, listed[dense_default]
    main(["models"])
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["model_type", "runs", "kernels", "experts", "class"]
    assert any(line.split()[:3] == ["mixtral", "yes", "fused"] for line in table)


def test_an_experts_class_wrapping_the_interface_is_refused_with_both_names(capsys):
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from mira.errors import MiraError
    from mira.models.interface import check_not_wrapped

    class NormedExperts(MixtralExperts):  # a forward of its own around the interface's (as Ergo's does)
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2 * super().forward(hidden_states, top_k_index, top_k_weights)

    check_not_wrapped(MixtralExperts)
    with pytest.raises(MiraError, match="NormedExperts wraps the experts interface's MixtralExperts"):
        check_not_wrapped(NormedExperts)
    main(["models", "--json"])
    listed = {row["model_type"]: row for row in json.loads(capsys.readouterr().out)["families"]}
    if "ergo" in listed:  # ErgoExperts' forward of its own is a per-route norm, which Mira computes
        assert listed["ergo"]["runs"] is True, listed["ergo"]
