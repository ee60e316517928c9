"""POST /v1/completions and /v1/chat/completions straight to their endpoints, past Starlette's
middleware stack and router (why: docs/design/hot-path.md#why-hotroutes-exists).

What the skipped stack did is done here with the app's own parts: its exception handlers answer
the errors as ServerErrorMiddleware and ExceptionMiddleware would. Any other layer in the stack
would be skipped on these two routes without a word, so there must be none: `skipped_layers`
names them, and HotRoutes refuses an app that has any (tests/gateway/test_hot_routes.py holds
the gateway's app to it). Add request-wide behaviour as pure-ASGI middleware around the whole
app instead, as gateway.app does.
"""

from __future__ import annotations

import inspect

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request

# The layers whose work HotRoutes does itself.
STAND_INS = (ServerErrorMiddleware, ExceptionMiddleware)


def skipped_layers(app: Starlette) -> list[str]:
    """The names of the layers of `app`'s middleware stack that HotRoutes would skip, beyond the
    two it stands in for (user middleware, Starlette's max_body_size, whatever a Starlette
    version adds)."""
    skipped, layer = [], app.build_middleware_stack()
    while layer is not app.router:
        if type(layer) not in STAND_INS:
            skipped.append(type(layer).__name__)
        layer = getattr(layer, "app", app.router)  # a layer that hides its inner app ends the walk
    return skipped


class HotRoutes:
    """Errors are answered as Starlette answers them, by the app's handlers: an exception with a
    handler (by status for an HTTPException, else by class) before the response starts by that
    handler; after the start, or one with no handler, as ServerErrorMiddleware does (the app's
    handler for Exception when nothing was sent yet, then re-raised for the server to log)."""

    def __init__(self, app: Starlette, endpoints: dict):
        self.app = app
        self.endpoints = endpoints
        self._adopt_handlers()

    def _adopt_handlers(self) -> None:
        """Take the app's exception handlers as its middleware stack does (see
        Starlette.build_middleware_stack), after checking that the stack has nothing more."""
        skipped = skipped_layers(self.app)
        if skipped:
            raise RuntimeError(f"HotRoutes would skip {', '.join(skipped)} on {', '.join(self.endpoints)}: "
                               "wrap the whole app in it instead (docs/design/hot-path.md)")
        # ExceptionMiddleware's own answer to an HTTPException, unless the app has one.
        self.by_class: dict = {HTTPException: ExceptionMiddleware(self.app.router).http_exception}
        self.by_status: dict = {}
        self.unexpected = None
        for key, handler in self.app.exception_handlers.items():
            if not inspect.iscoroutinefunction(handler):  # Starlette would run it in a thread
                raise RuntimeError(f"HotRoutes awaits the app's exception handlers; the one for {key!r} is not async")
            if key in (500, Exception):
                self.unexpected = handler
            elif isinstance(key, int):
                self.by_status[key] = handler
            else:
                self.by_class[key] = handler
        if self.unexpected is None:
            raise RuntimeError("HotRoutes answers unexpected errors with the app's handler for Exception; it has none")

    def handler_of(self, exc: Exception):
        """The app's handler for `exc` as ExceptionMiddleware finds it, or None."""
        if isinstance(exc, HTTPException) and exc.status_code in self.by_status:
            return self.by_status[exc.status_code]
        for cls in type(exc).__mro__:
            if cls in self.by_class:
                return self.by_class[cls]
        return None

    async def __call__(self, scope, receive, send):
        endpoint = self.endpoints.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if endpoint is None or scope.get("root_path"):
            return await self.app(scope, receive, send)
        scope["app"] = self.app
        request = Request(scope, receive, send)
        started = False

        async def sender(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            response = await endpoint(request)
            await response(scope, receive, sender)
        except Exception as exc:
            handler = self.handler_of(exc)
            if handler is not None and not started:
                await (await handler(request, exc))(scope, receive, sender)
                exc.__traceback__ = None  # as Starlette: a reused exception would pile up tracebacks
                return
            if handler is not None:
                raise_this: Exception = RuntimeError("Caught handled exception, but response already started.")
                raise_this.__cause__ = exc
            else:
                raise_this = exc
            answer = await self.unexpected(Request(scope), raise_this)  # it logs, started or not
            if not started:
                await answer(scope, receive, send)
            raise raise_this
