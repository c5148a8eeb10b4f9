"""The replicas of one Ray Serve application, sharing one ``CatalogHub`` actor
(``RayReplicas``, ``xgr.server.replicas.Replicas`` on Ray): whether all of them run, their
metrics in one scrape (``labelled``), and the log of catalog changes that each applies in
one order."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from xgr.core import XgrError

logger = logging.getLogger(__name__)

REPORT_S = 0.5  # how often a replica reports to the hub and applies the others' changes
STALE_S = 10.0  # a replica not heard from for this long is left out (it died)
LEASE_S = 120.0  # the longest one catalog change may take across the replicas
IDLE_REPORTS = 3  # reports in a row without requests: the replicas are drained
HUB_NAMESPACE = "xgr"


class CatalogHub:
    """What the replicas of one application share, held by one Ray actor (``hub``): the
    log of catalog changes in the order they were made, the lease that lets one replica at a
    time make one, and each replica's last report (changes applied, metrics text)."""

    def __init__(self) -> None:
        self.log: list[Any] = []
        self.holder: tuple[str, float] | None = None  # (replica, since: monotonic s)
        self.reports: dict[str, dict] = {}

    def acquire(self, replica: str) -> bool:
        """Take the lease (True), unless another replica holds it. A lease is taken back
        from a holder not heard from for ``STALE_S`` (it died), or held for ``LEASE_S``."""
        now = time.monotonic()
        if self.holder is not None and self.holder[0] != replica:
            holder, since = self.holder
            alive = holder in self.live() or now - since < STALE_S
            if alive and now - since < LEASE_S:
                return False
        self.holder = (replica, now)
        return True

    def release(self, replica: str) -> None:
        if self.holder is not None and self.holder[0] == replica:
            self.holder = None

    def append(self, replica: str, change: Any) -> int:
        """Log a change the lease holder applied; its number (from 1)."""
        if self.holder is None or self.holder[0] != replica:
            raise XgrError("a catalog change was logged without the lease")
        self.log.append(change)
        return len(self.log)

    def since(self, applied: int) -> list[tuple[int, Any]]:
        """The changes after the first ``applied``, numbered."""
        return list(enumerate(self.log[applied:], start=applied + 1))

    def report(
        self, replica: str, applied: int, metrics: bytes, failed: str | None, ongoing: int
    ) -> None:
        self.reports[replica] = {
            "applied": applied, "metrics": metrics, "failed": failed, "ongoing": ongoing,
            "at": time.monotonic(),
        }  # fmt: skip

    def idle(self) -> bool:
        """Whether no replica heard from holds a request."""
        return not any(v["ongoing"] for v in self.live().values())

    def live(self) -> dict[str, dict]:
        """The reports of the replicas heard from in the last ``STALE_S`` (the others are
        forgotten)."""
        now = time.monotonic()
        self.reports = {r: v for r, v in self.reports.items() if now - v["at"] < STALE_S}
        return self.reports


class RayReplicas:
    """``xgr.server.replicas.Replicas`` on Ray Serve: the siblings are the deployment's
    replicas, their shared state the application's ``CatalogHub`` actor. A thread reports
    this replica every ``REPORT_S`` and applies the changes the others logged."""

    def __init__(self, hub_name: str) -> None:
        from ray import serve

        context = serve.get_replica_context()
        self.app_name, self.deployment = context.app_name, context.deployment
        self.id = context.replica_id.unique_id
        self.hub = hub(hub_name)
        self.applied = 0
        self.failed: str | None = None
        self.ongoing = 0  # HTTP requests inside this replica's app (``Counted``)
        self._apply = None
        self._metrics = None
        self._lock = threading.Lock()  # one catch-up at a time
        self._changing = threading.Lock()  # one change of this replica's at a time
        self._whole = False  # every replica has run once (``waiting``)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, apply, metrics) -> None:
        self._apply, self._metrics = apply, metrics
        self._catch_up()
        self._report()
        self._thread = threading.Thread(target=self._follow, name="xgr-replicas", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _follow(self) -> None:
        while not self._stop.wait(REPORT_S):
            try:
                self._catch_up()
                self._report()
            except Exception:  # the hub unreachable for a while: try again next time
                logger.exception("replica %s: reporting to the catalog hub failed", self.id)

    def _catch_up(self) -> None:
        """Apply the changes logged since this replica's last (in order)."""
        import ray

        with self._lock:
            for number, change in ray.get(self.hub.since.remote(self.applied)):
                if self._apply is None:
                    self.failed = "the admin API is off here: catalog changes cannot be applied"
                else:
                    try:
                        self._apply(change)
                    except XgrError as exc:  # the replica that made it applied it
                        self.failed = f"change {number}: {exc}"
                        logger.error("replica %s: %s", self.id, self.failed)
                self.applied = number

    def _report(self) -> None:
        import ray

        report = self.hub.report.remote(
            self.id, self.applied, self._metrics(), self.failed, self.ongoing
        )
        ray.get(report)

    def waiting(self) -> str | None:
        """Why not every replica has started yet; None once they all ran, and from then on
        (a replacement or a scale-up does not take the service out of a load balancer)."""
        if self._whole:
            return None
        from ray import serve

        status = serve.status().applications[self.app_name]
        deployment = status.deployments[self.deployment]
        states = dict(deployment.replica_states)
        running = states.pop("RUNNING", 0)
        if deployment.status != "HEALTHY" or any(states.values()):
            waiting = ", ".join(f"{n} {state.lower()}" for state, n in states.items() if n)
            return f"{running} replicas running, {waiting or 'deployment ' + deployment.status}"
        self._whole = True
        return None

    def metrics(self, own: bytes) -> bytes:
        import ray

        texts = {r: v["metrics"] for r, v in ray.get(self.hub.live.remote()).items()}
        texts[self.id] = own
        return labelled(texts)

    def change(self, change, apply):
        with self._changing:  # the lease is this replica's: one of its changes holds it
            return self._change(change, apply)

    def _change(self, change, apply):
        import ray

        deadline = time.monotonic() + LEASE_S
        while not ray.get(self.hub.acquire.remote(self.id)):
            if time.monotonic() > deadline:
                raise XgrError("another replica's catalog change has not ended: try again")
            time.sleep(0.05)
        try:
            self._catch_up()  # the others' changes first: the same order everywhere
            with self._lock:
                answer = apply(change)  # refused: nothing logged, nothing changed
                self.applied = ray.get(self.hub.append.remote(self.id, change))
        finally:
            self.hub.release.remote(self.id)
        self._report()
        self._wait_applied(self.applied)
        return answer

    def _wait_applied(self, number: int) -> None:
        """Until every replica heard from has applied change ``number``.

        Raises:
            XgrError: one failed to apply it, or they did not within ``LEASE_S``.
        """
        import ray

        deadline = time.monotonic() + LEASE_S
        while True:
            reports = ray.get(self.hub.live.remote())
            failed = [f"{r}: {v['failed']}" for r, v in reports.items() if v["failed"]]
            if failed:
                raise XgrError(f"replicas failed to apply catalog changes: {'; '.join(failed)}")
            behind = [r for r, v in reports.items() if v["applied"] < number]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise XgrError(f"replicas {', '.join(behind)} did not apply the change in time")
            time.sleep(REPORT_S / 4)


def hub(name: str):
    """The ``CatalogHub`` actor of this name (in the namespace ``HUB_NAMESPACE``), made by
    the first process that asks; detached, so that it outlives any one replica (each
    ``application`` names a new one)."""
    import ray

    remote = ray.remote(num_cpus=0)(CatalogHub)
    return remote.options(
        name=name, namespace=HUB_NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()


def wait_idle(name: str, timeout: float) -> bool:
    """Until no replica of the hub ``name`` has held a request for ``IDLE_REPORTS``
    reports in a row (a request still queued at a proxy is routed to a free replica
    meanwhile), or ``timeout`` s; whether that happened."""
    import ray

    actor = hub(name)
    deadline, quiet = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        quiet = quiet + 1 if ray.get(actor.idle.remote()) else 0
        if quiet >= IDLE_REPORTS:
            return True
        time.sleep(REPORT_S)
    return False


class Counted:
    """ASGI wrapper counting the HTTP requests inside ``app`` on ``replicas.ongoing`` (what
    a replica reports, ``wait_idle``)."""

    def __init__(self, app, replicas: RayReplicas) -> None:
        self.app, self.replicas = app, replicas

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.replicas.ongoing += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.replicas.ongoing -= 1


def labelled(texts: dict[str, bytes]) -> bytes:
    """Several replicas' Prometheus texts as one, each sample labelled ``replica``."""
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.utils import floatToGoString

    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text.decode()):
            _, _, lines = families.setdefault(family.name, (family.documentation, family.type, []))
            for sample in family.samples:
                labels = {**sample.labels, "replica": replica}
                shown = ",".join(f'{k}="{_escaped(v)}"' for k, v in labels.items())
                lines.append(f"{sample.name}{{{shown}}} {floatToGoString(sample.value)}")
    out = []
    for name, (documentation, kind, lines) in families.items():
        shown = f"{name}_total" if kind == "counter" else name  # as prometheus_client writes it
        out += [f"# HELP {shown} {_escaped(documentation, quote=False)}", f"# TYPE {shown} {kind}"]
        out += lines
    return ("\n".join(out) + "\n").encode()


def _escaped(text: str, quote: bool = True) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text
