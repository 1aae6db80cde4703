"""`python -m runtime` on a worker node (SKYPILOT_NODE_RANK > 0): a Monarch worker loop on the
fixed port, which the controller attaches to, for exactly as long as the controller's run lasts.

The worker joins the controller's node watch (runtime/procs/nodewatch.py) and exits with the run's
exit code when the controller says it is done (1 after a failure, 2 after a user error: SkyPilot
marks a job by every node's exit code); with 1 when the controller goes away or never answers.
Monarch ends this process itself when the controller shuts the hosts down after a normal end or
a stop (exit 0). Either way no proc of this node outlives the worker.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

from runtime.procs.cluster import PORT_ENV, Cluster
from runtime.procs.nodewatch import Outcome, follow_controller

FORCED_EXIT_CODE = 130


def run_worker(cluster: Cluster, *, join_timeout: float) -> int:
    """Serve this node to the controller until the run ends, then exit the process with the
    run's exit code. Returns (2) only if this node cannot serve at all."""
    from runtime.procs.host import (
        MONARCH_ENV_DEFAULTS,
        RUN_ID_ENV,
        become_subreaper,
        kill_descendants,
        sweep_shared_memory,
    )

    def say(message: str, error: bool = False) -> None:
        where = sys.stderr if error else sys.stdout
        print(f"forgesky worker, {cluster.name(cluster.rank)}: {message}", file=where, flush=True)

    # Procs spawned here inherit this environment, as they would the controller's on node 0.
    for key, value in MONARCH_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    become_subreaper()
    from monarch.actor import start_worker_loop_forever

    address = cluster.url(cluster.rank)
    try:
        # A failure to listen (the port taken, an address not on this machine) ends the loop
        # at once; one that serves is still serving a moment later.
        start_worker_loop_forever(address=address, ca="trust_all_connections").get(timeout=1.0)
    except TimeoutError:
        pass
    except Exception as e:  # noqa: BLE001 - Monarch raises its own types; one line is the point
        say(
            f"error: cannot serve on {address}: {str(e).strip().splitlines()[0]}; pick another "
            f"port with --worker-port or {PORT_ENV} (on every node)",
            error=True,
        )
        return 2
    _ignore_first_stop(say)
    say(f"serving on {address}; joining the controller at {cluster.head}:{cluster.port}")
    try:
        outcome = follow_controller(
            cluster, join_timeout=join_timeout, on_joined=lambda head: say(f"joined {head}")
        )
    except KeyboardInterrupt:
        outcome = Outcome(FORCED_EXIT_CODE, "forced exit: killing this node's procs")
    say(outcome.reason, error=outcome.code != 0)
    kill_descendants(grace=0.0 if outcome.code == FORCED_EXIT_CODE else 2.0)
    if outcome.run_id:
        os.environ[RUN_ID_ENV] = outcome.run_id
        sweep_shared_memory()
    sys.stdout.flush()
    sys.stderr.flush()
    # Monarch's runtime threads live in this process: leave without unwinding into them.
    os._exit(outcome.code)


def _ignore_first_stop(say: Callable[[str], None]) -> None:
    # SIGTERM (a cancel, a preemption's shutdown) reaches every node at once, while the
    # controller checkpoints through the procs on this one: keep serving until it says done.
    stops = 0

    def handler(signum: int, _frame: object) -> None:
        nonlocal stops
        stops += 1
        if stops > 1 and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if stops == 1:
            say("stop requested: serving until the controller finishes (Ctrl-C again to force)")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
