"""The Ray Serve application: an ingress that reads each request and hands it to a replica of ``linnet
serve``'s engine, chosen by the prefix-aware router (or, with ``--router round-robin``, in turn).

Two deployments, as Ray's own LLM apps have: the router decides from a request's prompt, and Ray's HTTP
proxy does not read bodies, so a light ingress (no CPU reserved) reads the body, takes the prompt's text
from it and calls the replicas' handle, whose router (``PrefixAwareRouter``) sees that text. The replicas
answer with ``linnet serve``'s own app (``linnet.ray.replica``), relayed message by message.

A replica that dies before its response starts is retried once on another; one that dies mid-stream ends
the stream with an error chunk and ``[DONE]`` (a whole response: the connection is closed), never a hang.
"""
from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Mapping
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import ASGIApp, Receive, Scope, Send

from linnet.errors import LinnetError
from linnet.ray.replica import Forwarded, LinnetReplica
from linnet.ray.router import BLOCK_CHARS, prompt_text
from linnet.serve.body import BodyTooLarge
from linnet.serve.protocol import error_body

log = logging.getLogger("linnet.ray")
CHARS_PER_TOKEN = 4  # for sizing the router's record of a replica like its cache: English text, roughly
ATTEMPTS = 2  # a request whose replica dies before answering is tried once more, on another
# --router's choices: the RequestRouter classes of linnet.ray.request_router
ROUTERS = {"prefix": "linnet.ray.request_router.PrefixAwareRouter",
           "round-robin": "linnet.ray.request_router.RoundRobinRouter"}
DEFAULT_ROUTER = "prefix"


# as linnet serve's uvicorn: warnings and errors, no line per request
QUIET = {"log_level": "WARNING", "enable_access_log": False}
# The processes of the replicas and the ingress. Ray starts workers at niceness 15, below everything else on
# the machine: these are the service's own work, run at the priority `linnet serve` alone runs at (as Ray's
# job drivers are). Each streamed token crosses the ingress, so it runs Ray Serve's user code and router on
# its main event loop rather than hopping between threads for every message (Ray's throughput settings).
WORKER_ENV = {"RAY_worker_niceness": "0", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
              "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


# it reads and relays; the replicas compute
@serve.deployment(ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": WORKER_ENV}}, logging_config=QUIET)
@serve.ingress()
class LinnetIngress:
    def __init__(self, replicas: DeploymentHandle, max_body: int):
        self.replicas = replicas.options(stream=True)
        self.max_body = max_body

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The ingress's app, built on the replica after ``__init__``: one route, every path, relayed."""
        api = FastAPI(title="Linnet (Ray Serve)", openapi_url=None, docs_url=None, redoc_url=None)
        # a Starlette route (no signature analysis): this class travels to the replicas by value, without the
        # module globals FastAPI would need to resolve its postponed annotations
        api.add_route("/{path:path}", self.relay, methods=["GET", "POST"])
        return api

    async def relay(self, request: Request) -> Response:
        try:
            body = await read_body(request, self.max_body)
        except BodyTooLarge as e:
            return e.response()
        path, root = request.scope["path"], request.scope.get("root_path", "")
        if root and path.startswith(root):  # deployed under a route prefix: the replica's app routes from /
            path = path[len(root):] or "/"
        forwarded = Forwarded(request.method, path, request.scope.get("query_string", b""),
                              list(request.scope["headers"]), body, prefix_text(body))
        failure: Exception | None = None
        for attempt in range(ATTEMPTS):
            answer = cast(DeploymentResponseGenerator, self.replicas.forward.remote(forwarded))
            try:
                start = await answer.__anext__()
            except Exception as e:  # noqa: BLE001 (the replica died or was unreachable: nothing was sent yet)
                answer.cancel()
                log.warning("linnet: a replica failed before answering (attempt %d): %s", attempt + 1, e)
                failure = e
                continue
            return Relayed(start, answer)
        return JSONResponse(error_body(f"no replica could answer: {type(failure).__name__}", "server_error"),
                            status_code=503)


@serve.ingress()
class ServedReplica(LinnetReplica):
    """One replica with no router before it (``--replicas 1``, not autoscaling): Ray's HTTP proxy hands it
    each request, and it runs ``linnet serve``'s app on it: one Ray call a streamed token fewer than through
    the ingress (what that is worth: docs/SCALE.md)."""

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return self.served


class Relayed(Response):
    """A replica's response, its ASGI messages sent on as they come. If the replica fails mid-body, an
    event stream ends with an error event and ``[DONE]`` (as ``linnet serve`` ends a failed generation);
    any other body is cut short, which the client sees as a broken response rather than a wrong one."""

    def __init__(self, start: dict[str, Any], rest: DeploymentResponseGenerator):
        self.start, self.rest = start, rest
        self.status_code, self.background = start["status"], None  # what FastAPI reads of a Response
        self.event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                for k, v in start.get("headers", []))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(self.start)
        ended = False
        try:
            async for message in self.rest:
                await send(message)
                ended = not message.get("more_body", False)
        except Exception as e:  # noqa: BLE001 (the replica died mid-response)
            log.warning("linnet: a replica failed mid-response: %s", e)
            if self.event_stream:
                error = error_body(f"the replica serving this request failed: {type(e).__name__}", "server_error")
                await send({"type": "http.response.body", "more_body": False,
                            "body": f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()})
                return
            raise
        finally:  # the client went away (Ray cancels this task), or the response ended: stop the replica's work
            self.rest.cancel()
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused past ``limit`` bytes before more is read (the replica's app has the same limit)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def prefix_text(body: bytes) -> str:
    """The prompt's text for the router; empty for a body that is not JSON (the replica refuses it)."""
    try:
        return prompt_text(json.loads(body)) if body else ""
    except (ValueError, RecursionError):
        return ""


# -- building the application -------------------------------------------------------------------------
def build(args: argparse.Namespace, autoscaling: Mapping[str, Any] | None = None) -> serve.Application:
    """The application for ``linnet serve``'s parsed options ``args`` (``--replicas`` and the rest);
    ``autoscaling`` adds to Ray's autoscaling config (its delays, say) where ``--min-replicas`` is given."""
    check_scaling(args)
    options = {k: v for k, v in vars(args).items() if k != "func"}
    deployment: dict[str, Any] = {
        # two rows' worth per replica: the engine has a request waiting when a row frees; past that, Ray
        # holds requests at the router, which can still send them to another replica
        "max_ongoing_requests": 2 * args.rows,
        "ray_actor_options": {"num_cpus": args.threads or 1, "runtime_env": {"env_vars": WORKER_ENV}},
        "graceful_shutdown_timeout_s": args.drain_timeout,
        "logging_config": QUIET,
        "request_router_config": router_config(args),
    }
    if args.min_replicas is not None:
        deployment["autoscaling_config"] = {"min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                                            "initial_replicas": args.replicas or args.min_replicas,
                                            "target_ongoing_requests": args.rows, **(autoscaling or {})}
    else:
        deployment["num_replicas"] = args.replicas or 1
    if deployment.get("num_replicas") == 1:  # nothing to route: the replica takes HTTP from Ray's proxy itself
        del deployment["request_router_config"]
        return serve.deployment(name="LinnetReplica", **deployment)(ServedReplica).bind(options)
    replicas = serve.deployment(name="LinnetReplica", **deployment)(LinnetReplica).bind(options)
    # The ingress holds each request until its response ends, so its limit (Ray's default is 5) caps the
    # requests every replica together generates: it takes as many as the most replicas have room for.
    most = args.max_replicas if args.min_replicas is not None else args.replicas or 1
    ingress = LinnetIngress.options(max_ongoing_requests=most * deployment["max_ongoing_requests"])  # type: ignore[attr-defined]
    return ingress.bind(replicas, args.max_body)


def router_config(args: argparse.Namespace) -> RequestRouterConfig:
    """The request router ``--router`` names (``None``: the prefix-aware one); the prefix-aware router's
    record of each replica sized like the replica's cache rows."""
    name = args.router or DEFAULT_ROUTER
    if name not in ROUTERS:
        raise LinnetError(f"--router {name!r} is not a router (known: {', '.join(ROUTERS)})")
    kwargs = {}
    if name == "prefix":
        kwargs["record_blocks"] = max(1, args.rows * args.positions * CHARS_PER_TOKEN // BLOCK_CHARS)
    return RequestRouterConfig(request_router_class=ROUTERS[name],  # type: ignore[arg-type]
                               request_router_kwargs=kwargs)


def check_scaling(args: argparse.Namespace) -> None:
    if (args.min_replicas is None) != (args.max_replicas is None):
        raise LinnetError("--min-replicas and --max-replicas go together (autoscaling between them)")
    if args.min_replicas is not None:
        if args.min_replicas > args.max_replicas:
            raise LinnetError(f"--min-replicas {args.min_replicas} is more than --max-replicas {args.max_replicas}")
        if args.replicas is not None and not args.min_replicas <= args.replicas <= args.max_replicas:
            raise LinnetError(f"--replicas {args.replicas} (the replicas to start with) is outside "
                              f"--min-replicas {args.min_replicas} .. --max-replicas {args.max_replicas}")


class _Refusing(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise LinnetError(f"linnet.ray:app: {message}")


def serve_options(config: Mapping[str, Any]) -> argparse.Namespace:
    """``linnet serve``'s options from an application builder's arguments (``model=... rows=8``, or a
    config file's ``args:``): each key is the flag of the same name, parsed and checked by ``linnet
    serve``'s own parser; ``true`` gives a bare flag, ``false`` its ``--no-`` form."""
    from linnet.commands import serve as serve_command

    config = dict(config)
    argv = ["serve"] + ([str(config.pop("model"))] if "model" in config else [])
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True or str(value).lower() == "true":
            argv.append(flag)
        elif value is False or str(value).lower() == "false":
            argv.append("--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    parser = _Refusing(prog="linnet.ray:app")
    serve_command.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def app(config: dict[str, Any]) -> serve.Application:
    """``serve run linnet.ray:app model=PATH backend=onnx:cpu rows=8 replicas=2``, or a Serve config file's
    application with ``import_path: linnet.ray:app`` and these as ``args``."""
    return build(serve_options(config))
