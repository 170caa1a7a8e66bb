"""Managing the served models over HTTP (docs/serving.md, "Every model from one server"):

- llama-server's router endpoints: GET /models (every model, with its `status`), POST
  /models/load and /models/unload ({"model": NAME});
- Ollama's /api/pull (fetch a models.txt model as `flylocal models fetch` does, from the same
  sources with the same checksums, streaming ollama's progress lines) and /api/delete (remove a
  file flylocal fetched, never another tool's). Both need the API key where the server has
  one, and are refused on a server started with --no-manage.

A request's `model` is only ever looked up among the models found, or in models.txt for a
pull: it never names a path.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from flylocal.errors import FlylocalError
from flylocal.front.serve.app import ApiError, Endpoint, Exchange, Server
from flylocal.front.serve.ollama import Ollama
from flylocal.front.serve.openai import model_entries
from flylocal.front.serve.roster import CannotLoad


class Named(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    name: str | None = None             # ollama's older name of `model`
    stream: bool = True                 # /api/pull streams unless told not to
    insecure: bool | None = None

    def named(self) -> str:
        name = self.model if self.model is not None else self.name
        if not name:
            raise ApiError(400, "model is required", param="model")
        return name


class RouterModels(Endpoint):
    """GET /models: llama-server's router list, every model with its `status`."""
    name = "router_models"

    def job(self, x: Exchange) -> dict:
        return {"object": "list", "data": model_entries(self.server)}


class Load(Endpoint):
    """POST /models/load: load a model now (it then stays for its keep-alive); POST
    /models/unload: unload it once no request holds it."""
    name, body = "router_load", Named
    unload = False

    async def job(self, x: Exchange) -> dict:
        name = x.body.named()
        m = self.server.roster.find(name)
        if m is None:
            raise ApiError(404, f"model {name!r} not found; GET /models lists the models of this server",
                           param="model", code="model_not_found")
        if self.unload:
            if m.state not in ("loaded", "loading"):
                raise ApiError(400, f"model {name!r} is not loaded", param="model")
            self.server.roster.unload(m)
        else:
            try:
                await self.server.roster.load(m)
            except CannotLoad as e:
                raise ApiError(500, str(e), type_="server_error", code="model_load_failed") from None
        return {"success": True}


class Unload(Load):
    name, unload = "router_unload", True


class Managing(Ollama):
    """What /api/pull and /api/delete share: refused with --no-manage."""

    def job(self, x: Exchange) -> Any:
        if not self.server.manage:
            raise ApiError(403, "this server was started with --no-manage: it does not pull or delete models")
        return self.act(x, x.body.named())


class Pull(Managing):
    """/api/pull: a models.txt model fetched (or derived) into flylocal's cache, then served."""
    name, body = "ollama_pull", Named

    async def act(self, x: Exchange, name: str):
        from flylocal import models

        wanted = name.removesuffix(":latest")
        if wanted not in models.load_registry():
            raise ApiError(404, f"pull model manifest: {name!r} is not in flylocal's models.txt (`flylocal models "
                                "list` shows it); other models are fetched with their own tools")
        lines: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        done = threading.Event()

        def say(event: dict) -> None:
            loop.call_soon_threadsafe(lines.put_nowait, event)

        def fetch() -> None:
            try:
                path = models.fetch(wanted, log=lambda line: say({"status": line}))
                entry = models.load_registry()[wanted]
                size = path.stat().st_size
                say({"status": f"pulling {wanted}", "digest": f"sha256:{entry.sha256}", "total": size,
                     "completed": size})
                say({"status": "verifying sha256 digest"})
                say({"path": path})
            except FlylocalError as e:
                say({"error": str(e)})
            except Exception as e:  # noqa: BLE001 - said to the client, never a traceback
                say({"error": f"cannot pull {wanted}: {type(e).__name__}: {e}"})
            finally:
                done.set()

        say({"status": "pulling manifest"})
        threading.Thread(target=fetch, name="flylocal-pull", daemon=True).start()

        async def events():
            while True:
                event = await lines.get()
                if "path" in event:
                    self.server.models.adopt(wanted, event["path"])
                    yield {"status": "success"}
                    return
                yield event
                if "error" in event:
                    return

        if x.body.stream:
            async def ndjson():
                async for event in events():
                    yield json.dumps(event) + "\n"
            return StreamingResponse(ndjson(), media_type="application/x-ndjson")
        last = {}
        async for last in events():
            pass
        return JSONResponse(last, status_code=500 if "error" in last else 200)


class Delete(Managing):
    """/api/delete: a model flylocal fetched, unloaded and removed from its cache."""
    name, body = "ollama_delete", Named

    async def act(self, x: Exchange, name: str):
        from flylocal import models

        server = self.server
        m = server.roster.find(name)
        wanted = name.removesuffix(":latest")
        registry = models.load_registry()
        if m is None and wanted not in registry:
            raise ApiError(404, f"model {name!r} not found")
        own = models.local_path(m.name if m is not None and m.name in registry else wanted)
        if (m is not None and m.path != own) or not own.exists():
            raise ApiError(403 if m is not None else 404,
                           f"model {name!r} is not a file flylocal fetched: flylocal deletes only the models in its "
                           "cache (`flylocal models path` shows where); delete it with the tool that keeps it")
        if m is not None:
            if m.users:
                raise ApiError(409, f"model {name!r} is answering requests; delete it once they end")
            await server.roster.remove(m)
        own.unlink(missing_ok=True)
        models.stamp_path(own).unlink(missing_ok=True)
        return JSONResponse({})


def routes(app, server: Server) -> None:
    server.route(app, ["GET"], "/models", RouterModels(server))
    server.route(app, ["POST"], "/models/load", Load(server))
    server.route(app, ["POST"], "/models/unload", Unload(server))
    server.route(app, ["POST"], "/api/pull", Pull(server))
    server.route(app, ["DELETE", "POST"], "/api/delete", Delete(server))
