"""Megatron-Core under TP x PP x DP on CPU with gloo: same loss and gradients at every layout,
and a dist_checkpointing checkpoint saved at TP2 loads bit-exactly at TP1 (and at PP2)."""

import os

import pytest
import torch
from safetensors.torch import load_file

from laminar_mcore.models import get_adapter
from laminar_mcore.models.hf import initial_hf_state, tiny_hf_config
from laminar_mcore.testing.dist import run_torchrun

from .conftest import WORKERS

LAYOUTS = ["1x1", "2x1", "1x2", "2x2"]
pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def qwen2_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("layouts"))
    results = run_torchrun(os.path.join(WORKERS, "parallel_layouts.py"), 4,
                           ["--family", "qwen2", "--layouts", ",".join(LAYOUTS),
                            "--ckpt-save", "2x1", "--ckpt-load", "1x1,1x2"],
                           out_dir=out, timeout=600)
    return out, results


def _merged(out, prefix, layout):
    tensors = {}
    for stage in range(2):
        path = os.path.join(out, f"{prefix}_{layout}_pp{stage}.safetensors")
        if os.path.exists(path):
            part = load_file(path)
            assert not set(part) & set(tensors), "two stages hold the same tensor"
            tensors.update(part)
    return tensors


def _reference_full_state():
    cfg = tiny_hf_config("qwen2")
    model_cfg = type("M", (), {"path": None})()
    return get_adapter(cfg).hf_to_mcore(cfg, initial_hf_state(model_cfg, cfg, 7))


def test_loss_is_the_same_at_every_layout(qwen2_run):
    _, results = qwen2_run
    reference = results[0]["loss"]["1x1"]
    assert 4.0 < reference < 6.0  # a random tiny model on a 128-token vocabulary: ~ln(128)
    for r in results:
        for layout in LAYOUTS:
            assert abs(r["loss"][layout] - reference) <= 1e-5, (r["rank"], layout)


def test_gradients_are_the_same_at_every_layout(qwen2_run):
    out, _ = qwen2_run
    reference = _merged(out, "grads", "1x1")
    assert len(reference) == len(_reference_full_state())
    assert any(g.abs().max() > 0 for g in reference.values())
    for layout in LAYOUTS[1:]:
        grads = _merged(out, "grads", layout)
        assert set(grads) == set(reference), layout
        for name, g in grads.items():
            torch.testing.assert_close(g, reference[name], atol=1e-6, rtol=1e-4,
                                       msg=lambda m: f"{layout} {name}: {m}")


def test_dist_checkpoint_saved_at_tp2_loads_at_tp1_and_pp2(qwen2_run):
    out, results = qwen2_run
    full = _reference_full_state()
    saved_loss = results[0]["ckpt_loss"]["saved@2x1"]
    for layout in ("1x1", "1x2"):
        loaded = _merged(out, "loaded", layout)
        assert set(loaded) == set(full)
        for name, tensor in loaded.items():
            assert torch.equal(tensor, full[name]), f"{layout}: {name} differs after load"
        for r in results:
            # The freshly initialised model is different; after the load it is the saved one.
            assert abs(r["ckpt_loss"]["fresh@" + layout] - saved_loss) > 1e-3
            assert abs(r["ckpt_loss"][layout] - saved_loss) <= 1e-5


def test_every_rank_exports_its_own_slices_which_make_the_checkpoint_bit_for_bit(qwen2_run):
    """Issue 52, item 1: at every TP x PP layout each rank of the first replica exports its own
    Hugging Face slices (``iter_rank_hf_shards``: no gather); put together by their
    (dim, offset) they are the checkpoint the model was loaded from, bit for bit, each
    element exactly once. At TP2 a slice is half a tensor (split, not replicated)."""
    import glob

    out, _ = qwen2_run
    cfg = tiny_hf_config("qwen2")
    model_cfg = type("M", (), {"path": None})()
    hf = initial_hf_state(model_cfg, cfg, 7)
    for layout in LAYOUTS:
        pieces = {}
        for path in glob.glob(os.path.join(out, f"shards_{layout}_rank*")):
            for key, t in load_file(path).items():
                name, dim, offset = key.split("|")
                pieces.setdefault(name, []).append((None if dim == "None" else int(dim),
                                                    int(offset), t))
        assert set(pieces) == set(hf), (layout, set(hf) ^ set(pieces))
        tp = int(layout.split("x")[0])
        for name, parts in pieces.items():
            dims = {d for d, _, _ in parts}
            if dims == {None}:
                assert len(parts) == 1, f"{layout} {name}: a replicated tensor sent twice"
                got = parts[0][2]
            else:
                (dim,) = dims
                parts.sort(key=lambda p: p[1])
                assert len(parts) == tp and [p[1] for p in parts] == [
                    i * parts[0][2].shape[dim] for i in range(tp)], (layout, name)
                got = torch.cat([p[2] for p in parts], dim=dim)
            assert torch.equal(got, hf[name].to(got.dtype)), f"{layout} {name} differs"
        if tp == 2:
            assert {d for parts in pieces.values() for d, _, _ in parts} == {None, 0, 1}

