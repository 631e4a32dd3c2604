"""Benchmarks that measure ratios side by side in one run (never timed tests). Each takes
``--json PATH`` and writes its figures there as one flat object."""
