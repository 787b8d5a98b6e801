"""One module per bench, each behind the interface `harness.py` states (NAME, HELP, arguments,
measure); `BENCHES` is the order `cacheclip bench -h` lists them in."""

from . import (
    alignment,
    deviation,
    fidelity,
    gpu,
    http,
    index,
    load,
    niah,
    qa,
    recompute_profile,
    schedules,
    stages,
    store,
    ttft,
)

BENCHES = (niah, fidelity, deviation, ttft, stages, schedules, recompute_profile, gpu, alignment, http, load, qa, index, store)

__all__ = ["BENCHES"]
