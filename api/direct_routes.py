"""The busiest routes, served ahead of FastAPI's router.

FastAPI's routing and request handling took about 40% of the event loop's time on `POST /jobs` (py-spy at 64
clients): matching through its included routers, then solving parameters and dependencies, which it does
even for an endpoint with none to solve. The busiest routes need none of it: their endpoints are `async
def`, take the Request and their path parameters, read their body, headers and caller themselves, and return
a Response. `serve_directly` puts a Starlette route for each in front of FastAPI's: the same endpoint
function, path and methods, under the same middleware and exception handlers (the app's), with the APIRoute
as `scope["route"]` (so /metrics labels it as before). The APIRoute stays where it was: it is what the
OpenAPI document describes, and a request it does not take (another method on the path) goes on to FastAPI's
router as before.

`DirectLane`, the innermost of the app's own middleware, takes their requests there: past Starlette's
ExceptionMiddleware, FastAPI's exit-stack middleware and the router's walk (a tenth of the event loop's time
on POST /jobs). What those did for a direct route, it does: the scope gets the app's exception handlers (the
route's request_response handles its exceptions with them, as under ExceptionMiddleware) and the router.
"""

from __future__ import annotations

import inspect
from typing import Any, NoReturn

from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from starlette._utils import get_route_path
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.routing import BaseRoute, Match, NoMatchFound, request_response
from starlette.types import ASGIApp, Receive, Scope, Send


class DirectRoute(BaseRoute):
    """`route`'s endpoint as a plain Starlette endpoint (see the module's docstring)."""

    def __init__(self, route: APIRoute) -> None:
        endpoint = route.endpoint
        names = set(inspect.signature(endpoint).parameters)
        if not inspect.iscoroutinefunction(endpoint) or "request" not in names:
            raise TypeError(f"{route.path}: a direct route's endpoint is `async def` and takes `request`")
        if names - {"request"} != set(route.param_convertors) or route.dependencies:
            raise TypeError(f"{route.path}: a direct route takes only the request and path parameters")
        self.route = route
        self.methods = set(route.methods or ())  # no HEAD added, unlike Starlette's Route: FastAPI's methods

        async def call(request: Request) -> Any:
            return await endpoint(request=request, **request.path_params)

        self.app = request_response(call)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http" or scope["method"] not in self.methods:
            return Match.NONE, {}
        found = self.route.path_regex.match(get_route_path(scope))
        if found is None:
            return Match.NONE, {}
        convertors = self.route.param_convertors
        params = dict(scope.get("path_params", {}))
        params.update((name, convertors[name].convert(value)) for name, value in found.groupdict().items())
        return Match.FULL, {"endpoint": self.route.endpoint, "path_params": params, "route": self.route}

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    def url_path_for(self, name: str, /, **path_params: Any) -> NoReturn:
        raise NoMatchFound(name, path_params)  # the APIRoute answers for its name


def serve_directly(app: FastAPI, *endpoints: Any) -> None:
    """Serve the app's routes of `endpoints` (their functions) directly, ahead of its other routes."""
    wanted = set(endpoints)
    direct: list[DirectRoute] = []
    # FastAPI keeps an included router as a route of the app (an `_IncludedRouter`, with its context).
    for route in app.router.routes:
        context = getattr(route, "include_context", None)
        routes = route.original_router.routes if context is not None else [route]  # type: ignore[attr-defined]
        found = [DirectRoute(r) for r in routes if isinstance(r, APIRoute) and r.endpoint in wanted]
        if found and context is not None and (context.prefix or context.dependencies):
            # Its routes' paths or dependencies would not be the app's.
            raise ValueError("serve_directly: the router is included with a prefix or dependencies")
        direct.extend(found)
    missing = wanted - {route.route.endpoint for route in direct}
    if missing:
        raise ValueError(f"no route of the app has these endpoints: {sorted(f.__name__ for f in missing)}")
    app.router.routes[:0] = direct


class DirectLane:
    """Serves the app's direct routes (`serve_directly`) from where it sits in the middleware, and passes
    everything else on. Add it first (innermost): the app's other middleware stays around it."""

    def __init__(self, app: ASGIApp, fastapi_app: FastAPI) -> None:
        self.app = app
        self.router = fastapi_app.router
        # (The stack is built at the first request: routes and handlers are all there by then.)
        self.routes = [route for route in self.router.routes if isinstance(route, DirectRoute)]
        handlers = {k: v for k, v in fastapi_app.exception_handlers.items() if k not in (500, Exception)}
        tables = ExceptionMiddleware(app, handlers=handlers)  # its tables, as the app's stack has them
        self.exception_handlers = (tables._exception_handlers, tables._status_handlers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for route in self.routes:
                match, child_scope = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child_scope)
                    scope["starlette.exception_handlers"] = self.exception_handlers
                    scope.setdefault("router", self.router)
                    await route.handle(scope, receive, send)
                    return
        await self.app(scope, receive, send)
