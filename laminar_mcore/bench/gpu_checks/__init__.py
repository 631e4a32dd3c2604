"""The checks of ``python -m laminar_mcore.bench.gpu`` (see ``bench/gpu.py``), by subject."""
