"""The emulator's HTTP front: the real Kubernetes REST paths and JSON, plus `/emulator/*` controls.

Served paths (core `/api/v1`: nodes, namespaces, pods, secrets, configmaps; `/apis/batch/v1`: jobs;
and any `/apis/{group}/{version}` custom resource):

    GET    .../{plural}                    list (labelSelector, fieldSelector), or watch=true:
                                           a chunked stream of {"type","object"} lines from
                                           resourceVersion; an expired resourceVersion gets an
                                           ERROR event with a 410 "Expired" Status (as the API server);
                                           allowWatchBookmarks=true: BOOKMARK events when idle; with
                                           selectors, an object that comes to match is ADDED and one that
                                           stops matching DELETED (as the API server's watch cache)
    POST   .../{plural}                    create (409 AlreadyExists; a Secret's data must be base64,
                                           its stringData is merged into data)
    GET    .../{plural}/{name}[/status]    read (404 NotFound)
    PUT    .../{plural}/{name}[/status]    replace (409 Conflict on a stale resourceVersion)
    PATCH  .../{plural}/{name}             JSON merge patch (strategic merge patches of built-in kinds are
                                           applied as merge patches; a JSON patch: 400 if not a list,
                                           else 415, the emulator does not apply them). A Node patched
                                           with spec.unschedulable (a cordon) gets no new pod
    DELETE .../{plural}/{name}             delete (a Node too: the pods bound there run on until the pod garbage
                                           collector, after its quarantine (`pod_gc_quarantine_s`), marks them Failed
                                           (DisruptionTarget, DeletionByPodGC) and deletes them; Jobs: propagationPolicy
                                           Background/Foreground deletes what they own (pods, a Secret); the default
                                           orphans it, as the API does)
    GET    /api/v1/namespaces/{ns}/pods/{name}/log[?tailLines=N]

Controls (not Kubernetes): POST /emulator/nodes, /emulator/nodes/{name}/lose, /emulator/rules
(failure injection for new pods), /emulator/faults (HTTP errors such as 500 or 403, matched on method, path
and query string), /emulator/compact
(expire every resourceVersion so far); DELETE /emulator/rules, /emulator/faults; GET /emulator/state.
GET /emulator/requests: every API request served in RBAC's terms (user, verb, group, resource, subresource, namespace,
allowed, count; DELETE clears it). POST /emulator/tokens {"user": ...}: a bearer token for that user; POST /emulator/rbac
{"docs": [Role, ClusterRole, RoleBinding, ClusterRoleBinding...]}: RBAC in force for token users (a refused request
gets the API server's 403 Forbidden Status; a request without a token is the emulator's admin's, always allowed);
DELETE /emulator/rbac: everything allowed again (the default). See rbac.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from qosflow.k8s_emulator.rbac import Authorizer, RbacError, forbidden_message, request_attributes
from qosflow.k8s_emulator.state import ApiError, Cluster, fields_match, gpu_node, labels_match, merge_patch, parse_label_selector

_TRUE = ("true", "1", "yes")


def _err(e: ApiError) -> JSONResponse:
    return JSONResponse(e.status(), status_code=e.code)


def _parse(path: str):
    """(apiVersion, namespace, plural, name, subresource) of a REST path, or None."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        api, rest = "v1", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        api, rest = f"{parts[1]}/{parts[2]}", parts[3:]
    else:
        return None
    ns = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        ns, rest = rest[1], rest[2:]
    if not rest:
        return None
    plural = rest[0]
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else None
    return api, ns, plural, name, sub


def create_app(cluster: Cluster):
    store = cluster.store

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(cluster.run())
        try:
            yield
        finally:
            task.cancel()

    async def watch_stream(plural: str, ns: str | None, lsel: str | None, fsel: str | None, rv: str | None, timeout: float,
                           bookmarks: bool = False):
        reqs = parse_label_selector(lsel)

        def match(o: dict) -> bool:
            return (ns is None or o["metadata"].get("namespace") == ns) and labels_match(o["metadata"].get("labels") or {}, reqs) and fields_match(o, fsel)

        def filtered(erv: int, t: str, o: dict, prev: dict | None) -> tuple[str, dict] | None:
            """The event as a watch with selectors sees it (the API server's cacheWatcher): an object that comes to
            match is ADDED, one that stops matching (a pod whose phase becomes Succeeded under a field selector
            status.phase!=Succeeded) is DELETED, with its previous content at the event's resourceVersion."""
            if t == "DELETED":
                return (t, o) if match(o) else None
            now, before = match(o), prev is not None and match(prev)
            if now:
                return ("MODIFIED" if before and t == "MODIFIED" else "ADDED", o)
            if before:
                gone = copy.deepcopy(prev)
                gone["metadata"]["resourceVersion"] = str(erv)
                return ("DELETED", gone)
            return None

        def line(t: str, o: dict) -> bytes:
            return (json.dumps({"type": t, "object": o}) + "\n").encode()

        def gone(since: int) -> bytes:
            e = ApiError(410, "Expired", f"too old resource version: {since} ({store.compacted_rv + 1})")
            return line("ERROR", e.status())

        def bookmark(at: int) -> bytes:
            # (as the API server's: the object's kind and only metadata.resourceVersion, the version the stream has
            # reached; a client resumes from it without a LIST)
            api, kind, _ = store.meta.get(plural, ("v1", "", True))
            return line("BOOKMARK", {"kind": kind or "Object", "apiVersion": api, "metadata": {"resourceVersion": str(at)}})

        store.watches_open += 1
        store.watches_opened += 1
        store.watches_by[plural] = store.watches_by.get(plural, 0) + 1
        is_open = True
        compactions = store.compactions
        try:
            if rv not in (None, "", "0"):
                since = int(rv)
            else:  # no version: the current state as ADDED events, then changes
                since = store.current_rv
                for o in store.list(plural, ns, lsel, fsel):
                    yield line("ADDED", o)
            #: the version the stream has reached: every event up to it was looked at (of any kind: an established
            #: watch is not broken by changes to other resources rolling the event window past its last own event,
            #: as the API server's watch cache does not break it; `since` is its last own event)
            seen = since
            end = time.monotonic() + timeout
            while True:
                # expired: fallen out of the event window, or an explicit compaction (`/emulator/compact`: expire
                # every version so far, the open streams' too) after this stream's last own event
                if seen < store.compacted_rv or (store.compactions != compactions and since < store.compacted_rv):
                    store.watches_open -= 1  # (closed before the client reads the 410)
                    store.watches_by[plural] -= 1
                    is_open = False
                    yield gone(since)
                    return
                compactions = store.compactions  # (one that did not expire this stream is behind it)
                changed = store.changed
                log = list(store.log)
                batch = [(erv, t, o, prev) for erv, p, t, o, prev in log if erv > seen and p == plural]
                since = max([since] + [erv for erv, _, _, _ in batch])
                seen = max(seen, log[-1][0] if log else seen)
                for erv, t, o, prev in batch:
                    ev = filtered(erv, t, o, prev)
                    if ev is not None:
                        yield line(*ev)
                left = end - time.monotonic()
                if left <= 0:
                    return
                try:
                    await asyncio.wait_for(changed.wait(), min(left, store.bookmark_s))
                except asyncio.TimeoutError:
                    # idle: a BOOKMARK when the client allows them (allowWatchBookmarks), else an empty chunk to keep
                    # the chunked stream moving (clients ignore it)
                    yield bookmark(seen) if bookmarks else b""
        finally:
            if is_open:
                store.watches_open -= 1
                store.watches_by[plural] -= 1

    async def rest(request: Request) -> Response:
        parsed = _parse(request.url.path)
        if parsed is None:
            return _err(ApiError(404, "NotFound", f"the server could not find the requested resource ({request.url.path})"))
        api, ns, plural, name, sub = parsed
        q = request.query_params
        method = request.method
        try:
            if plural not in store.meta:
                if api in ("v1", "batch/v1"):
                    raise ApiError(404, "NotFound", f"the server could not find the requested resource ({plural})")
                store.meta[plural] = (api, "", True)  # a custom resource: kind comes from the object
            namespaced = store.meta[plural][2]
            obj_ns = (ns or "default") if namespaced else ""
            if name is None:
                if method == "GET":
                    if q.get("watch", "").lower() in _TRUE:
                        timeout = float(q.get("timeoutSeconds") or 1800)
                        parse_label_selector(q.get("labelSelector"))  # a bad selector is a 400 before the stream starts
                        return StreamingResponse(
                            watch_stream(plural, ns, q.get("labelSelector"), q.get("fieldSelector"), q.get("resourceVersion"), timeout,
                                         q.get("allowWatchBookmarks", "").lower() in _TRUE),
                            media_type="application/json",
                        )
                    items = store.list(plural, ns, q.get("labelSelector"), q.get("fieldSelector"))
                    kind = store.meta[plural][1] or (items[0]["kind"] if items else "Object")
                    return JSONResponse({"kind": f"{kind}List", "apiVersion": api, "metadata": {"resourceVersion": str(store.current_rv)}, "items": items})
                if method == "POST":
                    body = await request.json()
                    if namespaced and body.get("metadata", {}).get("namespace") not in (None, obj_ns):
                        raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
                    if not store.meta[plural][1]:
                        store.meta[plural] = (api, body.get("kind", ""), True)
                    obj = store.create(plural, obj_ns, body)
                    if plural == "jobs":
                        cluster.on_job_created(obj)
                    elif plural == "pods":
                        cluster.on_pod_created(obj)
                    return JSONResponse(obj, status_code=201)
                raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {plural}")
            if method == "GET":
                obj = store.get(plural, obj_ns, name)
                if sub == "log" and plural == "pods":
                    text = cluster.logs(obj)
                    tail = q.get("tailLines")
                    if tail is not None:  # the last N lines, as the API server gives them
                        if not tail.lstrip("-").isdigit():
                            raise ApiError(400, "BadRequest", f"tailLines: invalid value {tail!r}: an integer is expected")
                        n = int(tail)
                        lines = text.splitlines(keepends=True)
                        text = "".join(lines[-n:]) if n > 0 else ""
                    return PlainTextResponse(text)
                return JSONResponse(obj)
            if method == "PUT":
                body = await request.json()
                return JSONResponse(store.replace(plural, obj_ns, name, body, status_only=sub == "status"))
            if method == "PATCH":
                body = await request.json()
                ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
                if ctype == "application/json-patch+json" and not isinstance(body, list):
                    # (the API server's answer; kubernetes' Python client sends a dict as a strategic merge patch)
                    raise ApiError(400, "BadRequest", "json: cannot unmarshal object into Go value of type jsonpatch.Patch")
                if ctype == "application/strategic-merge-patch+json" and api not in ("v1", "batch/v1"):
                    raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - accepted media types "
                                                                "include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml")
                if isinstance(body, list):
                    raise ApiError(415, "UnsupportedMediaType", "the emulator supports merge patches only")
                cur = store.get(plural, obj_ns, name)
                want = (body.get("metadata") or {}).get("resourceVersion")
                new = merge_patch(cur, body)
                if not want:
                    new["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"]
                return JSONResponse(store.replace(plural, obj_ns, name, new))
            if method == "DELETE":
                try:
                    body = await request.json()
                except Exception:
                    body = {}
                prop = (body or {}).get("propagationPolicy") or q.get("propagationPolicy")
                grace = (body or {}).get("gracePeriodSeconds", q.get("gracePeriodSeconds"))
                obj = store.delete(plural, obj_ns, name, (body or {}).get("preconditions"))
                if plural == "jobs":
                    cluster.on_job_deleted(obj, prop, grace)
                if plural == "pods":
                    cluster.on_pod_deleted(obj, grace)
                if plural == "pods":
                    return JSONResponse(obj)
                group = api.split("/")[0] if "/" in api else ""
                return JSONResponse({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                     "details": {"name": name, "group": group, "kind": plural, "uid": obj["metadata"]["uid"]}})
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported")
        except ApiError as e:
            return _err(e)

    # -------------------------------------------------------------- controls
    async def ctl_nodes(request: Request) -> Response:
        b = await request.json()
        node = b if "metadata" in b else gpu_node(**b)
        try:
            return JSONResponse(cluster.add_node(node), status_code=201)
        except ApiError as e:
            return _err(e)

    async def ctl_lose(request: Request) -> Response:
        try:
            cluster.lose_node(request.path_params["name"])
        except ApiError as e:
            return _err(e)
        return JSONResponse({"lost": request.path_params["name"]})

    async def ctl_rules(request: Request) -> Response:
        if request.method == "DELETE":
            cluster.rules.clear()
            return JSONResponse({"rules": []})
        rule = await request.json()
        try:
            parse_label_selector(rule.get("selector"))  # a rule that could never match is an error now, not a silent no-op
        except ApiError as e:
            return _err(e)
        cluster.rules.append(rule)
        return JSONResponse({"rules": cluster.rules}, status_code=201)

    async def ctl_faults(request: Request) -> Response:
        if request.method == "DELETE":
            cluster.faults.clear()
            return JSONResponse({"faults": []})
        f = await request.json()
        f.setdefault("count", 1)
        f.setdefault("status", 500)
        cluster.faults.append(f)
        return JSONResponse({"faults": cluster.faults}, status_code=201)

    async def ctl_requests(request: Request) -> Response:
        if request.method == "DELETE":
            cluster.requests.clear()
        keys = ("user", "verb", "group", "resource", "subresource", "namespace", "allowed")
        return JSONResponse({"requests": [{**dict(zip(keys, k)), "count": n} for k, n in cluster.requests.items()]})

    async def ctl_rbac(request: Request) -> Response:
        if request.method == "DELETE":
            cluster.rbac = None
            return JSONResponse({"rbac": False})
        try:
            docs = (await request.json()).get("docs")
            if not isinstance(docs, list):
                raise RbacError('the body must be {"docs": [the RBAC manifests as JSON objects]}')
            cluster.rbac = Authorizer(docs)
        except (RbacError, ValueError, AttributeError) as e:
            return _err(ApiError(400, "BadRequest", f"RBAC manifests: {e}"))
        return JSONResponse({"rbac": True, "roles": len(cluster.rbac.roles), "bindings": len(cluster.rbac.bindings)}, status_code=201)

    async def ctl_tokens(request: Request) -> Response:
        user = (await request.json()).get("user")
        if not isinstance(user, str) or not user:
            return _err(ApiError(400, "BadRequest", 'the body must be {"user": "system:serviceaccount:NAMESPACE:NAME" (or another user name)}'))
        token = f"emulator-token-{len(cluster.tokens) + 1}"
        cluster.tokens[token] = user
        return JSONResponse({"user": user, "token": token}, status_code=201)

    async def ctl_compact(request: Request) -> Response:
        store.compact()
        return JSONResponse({"compacted_rv": store.compacted_rv})

    async def ctl_state(request: Request) -> Response:
        return JSONResponse({
            "emulator": "qosflow Kubernetes API emulator (not a real cluster)",
            "resourceVersion": store.current_rv, "compacted_rv": store.compacted_rv,
            "counts": {p: len(t) for p, t in store.objs.items()}, "rules": cluster.rules, "faults": cluster.faults,
            "watches": {"open": store.watches_open, "opened": store.watches_opened, "by_resource": dict(store.watches_by)},
            "traffic": cluster.traffic, "pod_gc": dict(cluster.pod_gc),
            "autoscaler": None if cluster.autoscaler is None else {
                "node_group": cluster.autoscaler.name, "min": cluster.autoscaler.min, "max": cluster.autoscaler.max,
                "log": list(cluster.autoscaler_log)},
        })

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    app = Starlette(
        routes=[
            Route("/emulator/nodes", ctl_nodes, methods=["POST"]),
            Route("/emulator/nodes/{name}/lose", ctl_lose, methods=["POST"]),
            Route("/emulator/rules", ctl_rules, methods=["POST", "DELETE"]),
            Route("/emulator/faults", ctl_faults, methods=["POST", "DELETE"]),
            Route("/emulator/compact", ctl_compact, methods=["POST"]),
            Route("/emulator/requests", ctl_requests, methods=["GET", "DELETE"]),
            Route("/emulator/rbac", ctl_rbac, methods=["POST", "DELETE"]),
            Route("/emulator/tokens", ctl_tokens, methods=["POST"]),
            Route("/emulator/state", ctl_state, methods=["GET"]),
            Route("/{path:path}", rest, methods=methods),
        ],
        lifespan=lifespan,
    )

    async def with_faults(scope, receive, send):
        """Pure ASGI wrapper: injected HTTP errors before routing (watch streams pass untouched), and the API's
        traffic counted (requests and response body bytes per verb and resource, as the API server's
        apiserver_request_total and apiserver_response_sizes metrics; `GET /emulator/state`'s "traffic")."""
        if scope["type"] == "http" and not scope["path"].startswith("/emulator"):
            method, path = scope["method"], scope["path"]
            parsed = _parse(path)
            query = scope.get("query_string", b"").decode(errors="replace")
            watching = method == "GET" and re.search(r"(^|&)watch=(true|1|yes)(&|$)", query, re.I) is not None
            verb = "WATCH" if watching else ("LIST" if method == "GET" and parsed is not None and parsed[3] is None else method)
            counter = cluster.traffic.setdefault(f"{verb} {parsed[2] if parsed else path}", {"requests": 0, "bytes": 0})
            counter["requests"] += 1
            inner_send = send

            async def send(message):  # noqa: F811 - the counted send
                if message["type"] == "http.response.body":
                    counter["bytes"] += len(message.get("body", b""))
                await inner_send(message)

            for f in cluster.faults:
                if (f["count"] > 0 and f.get("method", method).upper() == method and re.search(f.get("path", ""), path)
                        and re.search(f.get("query", ""), query)):
                    f["count"] -= 1
                    code = int(f["status"])
                    reason = {500: "InternalError", 503: "ServiceUnavailable", 429: "TooManyRequests", 409: "Conflict", 403: "Forbidden",
                              401: "Unauthorized"}.get(code, "InternalError")
                    resp = _err(ApiError(code, reason, f.get("message", f"Internal error occurred: injected by the emulator ({code})")))
                    await resp(scope, receive, send)
                    return
            refused = authorize(scope, method, path, query)
            if refused is not None:
                await _err(refused)(scope, receive, send)
                return
        await app(scope, receive, send)

    def authorize(scope, method: str, path: str, query: str) -> ApiError | None:
        """As the API server: the bearer token's user (none: the emulator's admin; a token of no user: 401), then RBAC
        (`cluster.rbac`) on that user's request (403 with the API server's message); the request recorded with its
        RBAC attributes and outcome (`cluster.requests`, `GET /emulator/requests`)."""
        attrs = request_attributes(method, path, query)
        if attrs is None:
            return None
        auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode(errors="replace")
        token = auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else ""
        user = cluster.tokens.get(token) if token else ""
        if user is None:
            return ApiError(401, "Unauthorized", "Unauthorized")
        allowed = not user or cluster.rbac is None or cluster.rbac.allows(user, attrs)
        key = (user, attrs.verb, attrs.group, attrs.resource, attrs.subresource, attrs.namespace, allowed)
        cluster.requests[key] = cluster.requests.get(key, 0) + 1
        if allowed:
            return None
        details = {"kind": attrs.resource, **({"group": attrs.group} if attrs.group else {}), **({"name": attrs.name} if attrs.name else {})}
        return ApiError(403, "Forbidden", forbidden_message(user, attrs), details)

    return with_faults
