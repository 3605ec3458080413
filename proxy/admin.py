"""Admin routes: list, add, drain and remove workers while the proxy runs.

They need `Authorization: Bearer ADMIN_KEY` (`--admin-key`, else `--api-key`); with neither
set they are refused, so an open proxy cannot be reconfigured by its clients.

- `GET /admin/workers`: each with its `source` (`static`, `admin`, or `dns://NAME:PORT`)
- `POST /admin/workers` `{"role": "prefill"|"decode", "url"}`: added, checked at once
- `POST /admin/workers/drain` `{"url", "migrate"?}`: no new requests; running ones finish, or
  with `"migrate": true` move at once to other decode workers and continue there
  (proxy/journey/migration.py)
- `POST /admin/workers/remove` `{"url"}`: gone from routing (running requests finish, then its
  client closes). A worker found by DNS comes back while its address still resolves.

With `--workers N` a change is applied by the process that receives it and then by every other
(`"processes"` in the answer counts those that did). Adding a worker that is there already,
draining or removing one that is not, changes nothing where it lands and still goes to every
process, so a retry repairs a change that one of them missed (a 404 only when no process knows
the worker). A list is the answering process's view; `GET /admin/workers?all=1` adds every
process's, under `processes`.
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError

from common.api.errors import APIError, InvalidRequestError, NotFoundError, UnavailableError
from common.api.http import json_body_openapi, read_json_body
from proxy.state import Proxy, check_key
from proxy.workers import check_worker_url


class AdminForbiddenError(APIError):
    status_code = 403
    error_type = "permission_error"


class AddWorker(BaseModel):
    role: Literal["prefill", "decode"]
    url: str


class WorkerRef(BaseModel):
    url: str


class DrainWorker(WorkerRef):
    migrate: bool = False


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

    def is_peer(request: Request) -> bool:
        return proxy.siblings is not None and proxy.siblings.is_peer(request.headers)

    @app.get("/admin/workers")
    async def list_workers(request: Request):
        """This process's view (with `--workers N`, each process checks the workers itself);
        `?all=1`: every process's too, under `processes`."""
        await authorized(request)
        workers = [w.describe() for w in proxy.all_workers()]
        answer = {"workers": workers, "process": proxy.process_index}
        every = request.query_params.get("all", "").lower() in ("1", "true", "yes")
        if every and not is_peer(request):
            auth = {"authorization": request.headers.get("authorization", "")}
            theirs = await proxy.siblings.views(auth) if proxy.siblings is not None else []
            answer["processes"] = sorted([dict(answer), *theirs], key=lambda v: v["process"])
        return answer

    async def everywhere(request: Request, body: BaseModel, answer: dict | None) -> dict:
        """A change applied here goes on to every sibling (proxy/siblings.py), whether or not
        this process needed it: a retry repairs a change that one of them missed. `answer` is
        this process's (None: it does not know the worker); a 404 when no process does."""
        if proxy.siblings is None or is_peer(request):
            if answer is None and not is_peer(request):
                raise NotFoundError(f"no worker {body.url!r}", param="url")
            return answer or {"url": body.url, "missing": True}
        auth = {"authorization": request.headers.get("authorization", "")}
        raw = body.model_dump_json().encode()
        theirs = await proxy.siblings.broadcast(request.url.path, raw, auth)
        applied = [a for a in theirs if a is not None]
        known = [a for a in [answer, *applied] if a is not None and not a.get("missing")]
        if not known:
            if len(applied) < len(theirs):
                raise UnavailableError(f"no process that answered knows {body.url!r}; try again")
            raise NotFoundError(f"no worker {body.url!r}", param="url")
        return {**known[0], "processes": 1 + len(applied)}

    @app.post("/admin/workers", openapi_extra=json_body_openapi(AddWorker))
    async def add_worker(request: Request):
        body = await body_of(request, AddWorker)
        try:
            url = check_worker_url(body.url)
        except ValueError as e:
            raise InvalidRequestError(str(e), param="url") from e
        worker = proxy.find_worker(url)  # known already (a retry, or found by DNS): kept
        if worker is not None and worker.role != body.role:
            raise InvalidRequestError(f"{url} is already a {worker.role} worker", param="url")
        worker = worker or await proxy.admit_worker(body.role, url, "admin")
        return await everywhere(request, body, worker.describe())

    @app.post("/admin/workers/drain", openapi_extra=json_body_openapi(DrainWorker))
    async def drain_worker(request: Request):
        body = await body_of(request, DrainWorker)
        worker = proxy.find_worker(body.url)
        if worker is not None:
            worker.is_draining = True
            if body.migrate:
                proxy.orchestrator.inflight.cut(worker, "drain")
        return await everywhere(request, body, worker and worker.describe())

    @app.post("/admin/workers/remove", openapi_extra=json_body_openapi(WorkerRef))
    async def remove_worker(request: Request):
        body = await body_of(request, WorkerRef)
        worker = proxy.find_worker(body.url)
        if worker is not None:
            proxy.remove_worker(worker)
        return await everywhere(request, body, worker and {**worker.describe(), "removed": True})
