#!/usr/bin/env bash
# TRL's wheels for the TRL baseline (bench/trl_grpo.py, `scripts/gpu/device_run.sh trl`), under
# .whl/trl/: trl 1.16.0, the version of the reference measurement (TRL_VERSION=... to change).
exec "$(dirname "$0")/prepare_extra_wheels.sh" trl "trl==${TRL_VERSION:-1.16.0}"
