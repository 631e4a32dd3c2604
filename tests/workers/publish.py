"""Worker (under torchrun): a TP x PP trainer publishes its weights to the master relay."""

import argparse
import os

import torch


def _hold(path, timeout_s=300.0):
    """Every rank waits (rank 0 polls, then a barrier) until ``path`` exists."""
    import time
    if torch.distributed.get_rank() == 0:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")
            time.sleep(0.05)
    torch.distributed.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--relay-host", default="127.0.0.1")
    ap.add_argument("--publish-port", type=int, default=None)
    ap.add_argument("--master-relays", default="",
                    help="a striped tier: HOST:PORT of each stripe's master relay, comma-separated")
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--bucket-bytes", type=int, default=40_000)
    ap.add_argument("--export", default="stage_lead",
                    help="comma-separated weight_sync.export values, published in turn")
    ap.add_argument("--hold-dir", default=None,
                    help="after each export way but the last, wait for DIR/<export>.go (the "
                         "test's puller writes it once it has checked that way's last version)")
    ap.add_argument("--hold-at", default="",
                    help="versions (comma-separated) before which every rank waits for "
                         "DIR/v<V>.go (DIR: --hold-dir)")
    ap.add_argument("--locate-dir", default=None,
                    help="a lost master relay's successor: DIR/successor-<port> holds its "
                         "HOST:PORT once the test has promoted one")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from laminar_mcore.models import get_adapter
    from laminar_mcore.models.hf import initial_hf_state, tiny_hf_config
    from laminar_mcore.parallel import init_trainer_parallel
    from laminar_mcore.testing.dist import write_rank_result
    from laminar_mcore.trainer.model import build_gpt_model, load_full_state
    from laminar_mcore.trainer.publisher import WeightPublisher

    torch.set_num_threads(1)
    init_trainer_parallel(tp=args.tp, pp=args.pp, seed=0)
    cfg = tiny_hf_config("qwen2")
    model = build_gpt_model(cfg)
    out = {"rank": int(os.environ["RANK"])}

    def locate(failed):  # (WeightPublisher retries until failover_timeout_s)
        path = os.path.join(args.locate_dir or "", f"successor-{failed[1]}")
        if not args.locate_dir or not os.path.exists(path):
            raise ConnectionError(f"no successor of {failed[0]}:{failed[1]} yet")
        host, port = open(path).read().strip().rsplit(":", 1)
        return host, int(port)

    version = 0
    for export in args.export.split(","):  # one after the other, versions numbered on
        publisher = WeightPublisher(model, cfg, relay_host=args.relay_host,
                                    publish_port=args.publish_port, master_relays=[
                                        (h, int(p)) for h, p in (a.rsplit(":", 1) for a in
                                                                 args.master_relays.split(",") if a)],
                                    bucket_bytes=args.bucket_bytes, chunk_bytes=8192,
                                    export=export,
                                    locate_master=locate if args.locate_dir else None)
        stats = []
        for _ in range(args.versions):
            version += 1
            if str(version) in args.hold_at.split(","):
                _hold(os.path.join(args.hold_dir, f"v{version}.go"))
            # Version v carries the weights of HF init seed v, so each is checkable on its own.
            state = initial_hf_state(type("M", (), {"path": None})(), cfg, version)
            load_full_state(model, cfg, get_adapter(cfg).hf_to_mcore(cfg, state))
            s = publisher.publish(version)
            stats.append({"version": version, "blocked_s": s.blocked_s, "nbytes": s.nbytes,
                          "buckets": s.buckets})
            publisher.wait()
        publisher.close()
        if args.hold_dir and export != args.export.split(",")[-1]:
            _hold(os.path.join(args.hold_dir, f"{export}.go"))
        out[export] = {"lead": publisher.is_lead, "part": publisher.stage,
                       "failovers": publisher.failovers,
                       "stripe": publisher.stripe, "stats": stats,
                       "host_buffer_bytes": publisher.pinned_bytes(),
                       "backend": publisher.backend}
    write_rank_result(args.out, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
