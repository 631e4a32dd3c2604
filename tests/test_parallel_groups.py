"""The trainer's groups: trainer.collective_timeout_s reaches Megatron's subgroups, not only the
world group (Megatron-Core's default for them is 30 minutes), so a hung TP/PP/DP/EP collective
fails as fast as a hung world collective."""

import datetime

import torch


def _timeout(group) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def test_megatron_subgroups_get_the_configured_collective_timeout():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel

    init_trainer_parallel(tp=1, pp=1, seed=0, timeout_s=42.0)
    try:
        groups = {"world": dist.group.WORLD,
                  "tp": ps.get_tensor_model_parallel_group(),
                  "pp": ps.get_pipeline_model_parallel_group(),
                  "dp": ps.get_data_parallel_group(),
                  "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
                  "mp": ps.get_model_parallel_group(),
                  "ep": ps.get_expert_model_parallel_group(),
                  "expert_dp": ps.get_expert_data_parallel_group()}
        assert {name: _timeout(g) for name, g in groups.items()} == \
            {name: datetime.timedelta(seconds=42) for name in groups}
    finally:
        destroy_trainer_parallel()


def test_te_counts_as_importable_only_when_its_torch_layers_load(monkeypatch):
    """A Transformer Engine whose top-level package imports but whose torch extension does not
    load (built for another torch) is not usable: Megatron falls back to local layers, and the
    trainer must pick the same."""
    import sys
    import types

    from laminar_mcore.trainer.model import te_importable

    assert not te_importable()  # no TE on this machine
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)  # its import fails
    assert not te_importable()
    te_torch = types.ModuleType("transformer_engine.pytorch")
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_torch)
    sys.modules["transformer_engine"].pytorch = te_torch
    assert te_importable()
