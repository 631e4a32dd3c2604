"""Checkpoint saves write in the calling process: Megatron's torch_dist writer gets an in-process
results queue instead of a spawned Manager process per rank (which re-imports the rank's whole
main module), and the checkpoint it writes loads back bit for bit."""

import json
import os
import subprocess
import sys

PROBE = r"""
import json, multiprocessing, sys, torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from laminar_mcore.models.hf import tiny_hf_config
from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel
from laminar_mcore.trainer.dist_save import save_sharded
from laminar_mcore.trainer.model import build_gpt_model

init_trainer_parallel(tp=1, pp=1, seed=0)
cfg = tiny_hf_config("qwen2")
model = build_gpt_model(cfg)
save_sharded(model.sharded_state_dict(), sys.argv[1])
children = [p.name for p in multiprocessing.active_children()]
other = build_gpt_model(cfg)
with torch.no_grad():
    for p in other.parameters():
        p.add_(1.0)
other.load_state_dict(dist_checkpointing.load(other.sharded_state_dict(), sys.argv[1]))
same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values())
           if isinstance(a, torch.Tensor))
print(json.dumps({"children": children, "same": same,
                  "queue": type(filesystem_async._results_queue).__module__}))
destroy_trainer_parallel()
"""


def test_a_checkpoint_save_starts_no_process_and_loads_back_bit_for_bit(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    env = dict(os.environ, PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0")
    from laminar_mcore.netutil import free_port

    env["MASTER_PORT"] = str(free_port())
    out = subprocess.run([sys.executable, "-c", PROBE, str(ckpt)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"children": [], "same": True, "queue": "queue"}
    assert any(name.endswith(".distcp") for name in os.listdir(ckpt))
