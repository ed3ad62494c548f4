"""The page to watch a server by (``GET /`` and ``/dashboard``) and the JSON it reads.

The page is three files in the package (``static/``: HTML, CSS, JavaScript — no build step,
nothing fetched from outside: the machines that serve big models often have no internet). It
asks ``/metrics.json`` once a second: every sample ``/metrics`` shows, read from the same
registry in the same way (``name{label="value",…}`` with the labels sorted, as Prometheus's
parser names them), so a figure on the page is the figure ``/metrics`` gives; the routing of
the last tokens per layer and expert (``routingheat``) when the server captures routing; and
what the server is (its name, the prefetch mode).
"""

from __future__ import annotations

import math
import time
from importlib import resources
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .routingheat import RoutingHeat

FILES = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
}
PAGES = {
    "/": "dashboard.html",
    "/dashboard": "dashboard.html",
    "/dashboard.css": "dashboard.css",
    "/dashboard.js": "dashboard.js",
}


def samples(registry: CollectorRegistry) -> dict[str, float | None]:
    """Every sample of ``registry`` by its name and sorted labels (non-finite: None)."""
    out: dict[str, float | None] = {}
    for family in registry.collect():
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            value = float(s.value)
            out[f"{s.name}{{{labels}}}" if labels else s.name] = (
                value if math.isfinite(value) else None
            )
    return out


def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


def add_dashboard(
    app: Any, registry: CollectorRegistry, heat: RoutingHeat | None, server: dict[str, Any]
) -> None:
    """The page's routes and ``/metrics.json`` on ``app`` (the files are read once)."""
    files = {name: _static(name) for name in FILES}

    def page(name: str) -> Any:
        async def endpoint(request: Request) -> Response:
            return Response(
                files[name], media_type=FILES[name], headers={"cache-control": "no-cache"}
            )

        return endpoint

    async def metrics_json(request: Request) -> Response:
        return JSONResponse(
            {
                "time": time.time(),
                "server": server,
                "metrics": samples(registry),
                "routing": heat.to_json() if heat is not None else None,
            },
            headers={"cache-control": "no-store"},
        )

    for path, name in PAGES.items():
        app.add_route(path, page(name), methods=["GET"])
    app.add_route("/metrics.json", metrics_json, methods=["GET"])
