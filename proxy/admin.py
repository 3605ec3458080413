"""Admin routes: list, add, drain and remove workers while the proxy runs.

They need `Authorization: Bearer ADMIN_KEY` (`--admin-key`, else `--api-key`); with neither
set they are refused, so an open proxy cannot be reconfigured by its clients.

- `GET /admin/workers`: each with its `source` (`static`, `admin`, or `dns://NAME:PORT`)
- `POST /admin/workers` `{"role": "prefill"|"decode", "url"}`: added, checked at once
- `POST /admin/workers/drain` `{"url"}`: no new requests; running ones finish
- `POST /admin/workers/remove` `{"url"}`: gone from routing (running requests finish, then its
  client closes). A worker found by DNS comes back while its address still resolves.

With `--workers N` a change is applied by the process that receives it and then by every other
(`"processes"` in the answer counts those that did); a list is the answering process's view.
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError

from common.api.errors import APIError, InvalidRequestError, NotFoundError
from common.api.http import json_body_openapi, read_json_body
from proxy.state import Proxy, check_key
from proxy.workers import Worker, check_worker_url


class AdminForbiddenError(APIError):
    status_code = 403
    error_type = "permission_error"


class AddWorker(BaseModel):
    role: Literal["prefill", "decode"]
    url: str


class WorkerRef(BaseModel):
    url: str


def install_admin_routes(app: FastAPI, proxy: Proxy) -> None:
    async def authorized(request: Request) -> None:
        key = proxy.cfg.effective_admin_key
        if key is None:
            raise AdminForbiddenError("admin routes are off: start the proxy with --admin-key")
        check_key(request, key)

    async def body_of(request: Request, model):
        await authorized(request)
        try:
            return model.model_validate(await read_json_body(request, 4096))
        except ValidationError as e:
            first = e.errors()[0]
            raise InvalidRequestError(first["msg"], param=".".join(map(str, first["loc"]))) from e

    def find(url: str) -> Worker:
        worker = proxy.find_worker(url)
        if worker is None:
            raise NotFoundError(f"no worker {url!r}", param="url")
        return worker

    @app.get("/admin/workers")
    async def list_workers(request: Request):
        """This process's view (with `--workers N`, each process checks the workers itself)."""
        await authorized(request)
        workers = [w.describe() for w in proxy.all_workers()]
        return {"workers": workers, "process": proxy.process_index}

    async def to_siblings(request: Request, body: BaseModel, answer: dict) -> dict:
        """With `--workers N`: the same change on every other process (proxy/siblings.py)."""
        if proxy.siblings is None or proxy.siblings.is_peer(request.headers):
            return answer
        auth = {"authorization": request.headers.get("authorization", "")}
        path = request.url.path
        applied = await proxy.siblings.broadcast(path, body.model_dump_json().encode(), auth)
        return {**answer, "processes": 1 + applied}

    def is_peer(request: Request) -> bool:
        return proxy.siblings is not None and proxy.siblings.is_peer(request.headers)

    @app.post("/admin/workers", openapi_extra=json_body_openapi(AddWorker))
    async def add_worker(request: Request):
        body = await body_of(request, AddWorker)
        try:
            url = check_worker_url(body.url)
        except ValueError as e:
            raise InvalidRequestError(str(e), param="url") from e
        if (known := proxy.find_worker(url)) is not None:
            if is_peer(request):  # a sibling's change this process already has (e.g. by DNS)
                return known.describe()
            raise InvalidRequestError(f"{url} is already a worker", param="url")
        worker = await proxy.admit_worker(body.role, url, "admin")
        return await to_siblings(request, body, worker.describe())

    @app.post("/admin/workers/drain", openapi_extra=json_body_openapi(WorkerRef))
    async def drain_worker(request: Request):
        body = await body_of(request, WorkerRef)
        if is_peer(request) and proxy.find_worker(body.url) is None:
            return {"url": body.url, "missing": True}
        worker = find(body.url)
        worker.is_draining = True
        return await to_siblings(request, body, worker.describe())

    @app.post("/admin/workers/remove", openapi_extra=json_body_openapi(WorkerRef))
    async def remove_worker(request: Request):
        body = await body_of(request, WorkerRef)
        if is_peer(request) and proxy.find_worker(body.url) is None:
            return {"url": body.url, "missing": True}
        worker = find(body.url)
        proxy.remove_worker(worker)
        return await to_siblings(request, body, {**worker.describe(), "removed": True})
