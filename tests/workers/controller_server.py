"""A controller in a process of its own, as ``job=controller`` runs it (controller/role.py):
started from the main thread, stopped in a ``finally`` -- for the SIGTERM test. Prints its URL
(``LAMINAR_CONTROLLER_URL=``) and ``LAMINAR_CONTROLLER_STOPPED`` once ``stop()`` returned."""

import os
import sys
import time


def main():
    out = sys.argv[1]
    from laminar_mcore.config.schema import LaminarConfig
    from laminar_mcore.controller.episode import TaskCodec
    from laminar_mcore.controller.server import Controller, TaskData
    from laminar_mcore.metrics import MetricsWriter
    from laminar_mcore.netutil import TOKEN_ENV

    task = TaskData(rows=[{"prompt": "ab", "answer": "ba"}] * 4, evals=[],
                    codec=TaskCodec(lambda row: [1, 2], lambda ids: ""), model_path="/none")
    metrics = MetricsWriter(out, loggers=["jsonl"])
    controller = Controller(LaminarConfig(output_dir=out), task, metrics,
                            os.environ[TOKEN_ENV])
    try:
        print(f"LAMINAR_CONTROLLER_URL={controller.start()}", flush=True)
        while True:
            time.sleep(1.0)
    finally:
        controller.stop()
        metrics.close()
        print("LAMINAR_CONTROLLER_STOPPED", flush=True)


if __name__ == "__main__":
    main()
