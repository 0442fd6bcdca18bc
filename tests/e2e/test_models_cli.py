"""`mira models`: the MoE families of the installed transformers and whether Mira runs them."""

import json

from mira.cli import main
from mira.models.interface import moe_families


def test_mira_models_lists_every_interface_family_with_what_mira_does(capsys):
    main(["models", "--json"])
    listed = {row["model_type"]: row for row in json.loads(capsys.readouterr().out)["families"]}
    assert set(listed) == {family.model_type for family in moe_families()}
    assert listed["mixtral"]["runs"] is True and listed["mixtral"]["kernels"] == "fused"
    assert listed["gpt_oss"]["runs"] is True and listed["gpt_oss"]["kernels"] == "fused"  # biases, clamped SwiGLU
    assert listed["nemotron_h"]["kernels"] == "reference"  # ungated experts
    if "bailing_hybrid" in listed:  # its Experts take the layer index (a clamp per layer)
        assert listed["bailing_hybrid"]["runs"] is True
    main(["models"])
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["model_type", "runs", "kernels", "experts", "class"]
    assert any(line.split()[:3] == ["mixtral", "yes", "fused"] for line in table)
