"""Store format versions: layouts without biases or ungated experts stay version 1 (read by any
Mira), those with them are version 2, int4 stores (tiled codes) version 3, and a manifest whose
version does not fit its layout is refused."""

import json

import pytest
import torch

from mira.errors import MiraError
from mira.store.layout import ExpertLayout
from mira.store.manifest import FORMAT_VERSION, Manifest, format_version

H, I = 64, 32


def _manifest(tmp_path, layout: ExpertLayout, version: int):
    data = {"format_version": version, "model_type": "gpt_oss", "source": "src", "source_fingerprint": "f",
            "moe_layers": [0], "num_experts": 4, "layout": layout.to_json(), "files": {}}
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    return Manifest.read(tmp_path)


def test_a_plain_layout_is_version_1_and_its_json_is_the_first_formats():
    layout = ExpertLayout("int8-shared", H, I)
    assert format_version(layout) == FORMAT_VERSION == 1
    assert set(layout.to_json()) == {"scheme", "hidden", "intermediate", "weight_dtype", "nbytes", "sections"}


@pytest.mark.parametrize("fields", [dict(bias=True), dict(gated=False), dict(bias=True, gated=False)])
def test_biases_and_ungated_experts_are_version_2_and_read_back(tmp_path, fields):
    layout = ExpertLayout("int8-row", H, I, **fields)
    assert format_version(layout) == 2
    assert _manifest(tmp_path, layout, 2).expert_layout == layout
    rows = I if fields.get("gated") is False else 2 * I
    assert layout.sections["w13"].shape == (rows, H) and layout.sections["scale13"].shape == (rows,)
    if fields.get("bias"):
        assert layout.sections["b13"].shape == (rows,) and layout.sections["b2"].shape == (H,)
        assert layout.sections["b2"].dtype == torch.float32


def test_a_version_1_manifest_with_a_version_2_layout_is_refused(tmp_path):
    with pytest.raises(MiraError, match="malformed.*format version 1 with a layout of version 2"):
        _manifest(tmp_path, ExpertLayout("none", H, I, torch.bfloat16, bias=True), 1)


def test_int4_stores_are_version_3_and_older_int4_stores_are_refused_with_the_fix(tmp_path):
    layout = ExpertLayout("int4", H, H)
    assert format_version(layout) == 3
    assert _manifest(tmp_path, layout, 3).expert_layout == layout
    with pytest.raises(MiraError, match="int4 experts in an older blob layout.*mira convert src"):
        _manifest(tmp_path, layout, 1)
    ungated = ExpertLayout("int4", H, H, gated=False)  # up rows only: half of w13's codes and scales
    assert format_version(ungated) == 3 and _manifest(tmp_path, ungated, 3).expert_layout == ungated
    assert ungated.sections["w13"].shape == (H, H // 2) and ungated.sections["sz13"].shape[1] == H


def test_a_blob_with_biases_packs_and_views_every_section():
    layout = ExpertLayout("none", H, I, torch.float32, bias=True)
    tensors = {"w13": torch.randn(2 * I, H), "w2": torch.randn(H, I), "b13": torch.randn(2 * I), "b2": torch.randn(H)}
    blob = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.pack(tensors, blob)
    views = layout.views(blob)
    assert all(torch.equal(views[name], tensor) for name, tensor in tensors.items())


def test_an_experts_weights_are_counted_alike_in_every_scheme():
    hidden, intermediate = 128, 64
    gated = 2 * intermediate * hidden + hidden * intermediate  # gate and up [I, H] each, down [H, I]
    for scheme in ("int8-shared", "int8-row", "int4", "none"):
        weight_dtype = torch.bfloat16 if scheme == "none" else torch.int8
        assert ExpertLayout(scheme, hidden, intermediate, weight_dtype).weights == gated
    assert ExpertLayout("int8-shared", hidden, intermediate, gated=False, bias=True).weights == 2 * hidden * intermediate
