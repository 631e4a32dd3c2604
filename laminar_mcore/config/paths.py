"""Where the Hydra config tree is: the repository's conf/ (source checkout or editable
install) or the copy installed as package data (laminar_mcore/conf)."""

from __future__ import annotations

import os


def conf_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "..", "..", "conf"), os.path.join(here, "..", "conf")):
        if os.path.isfile(os.path.join(candidate, "config.yaml")):
            return os.path.normpath(candidate)
    raise FileNotFoundError("laminar_mcore's conf/ directory is missing from this installation")
