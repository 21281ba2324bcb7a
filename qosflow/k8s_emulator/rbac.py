"""The emulator's RBAC: what a request asks for in RBAC's terms, and whether a set of RBAC manifests allows it.

THIS IS AN EMULATOR, NOT KUBERNETES' AUTHORIZER, but it follows its rules: a request's attributes (`request_attributes`:
verb get/list/watch/create/update/patch/delete/deletecollection, API group, resource, subresource, namespace or none
for the cluster scope, name) as the API server's RequestInfoFactory derives them from the method, path and query; the
rules that apply to a user (`Authorizer`: ClusterRoleBindings anywhere, RoleBindings in the request's namespace only,
to a Role or a ClusterRole; subjects ServiceAccount, User or Group, a ServiceAccount being in the groups
system:serviceaccounts, system:serviceaccounts:NAMESPACE and system:authenticated); a rule's match (`rule_allows`:
apiGroups, resources as "resource", "resource/subresource", "*/subresource" or "*", verbs, resourceNames); and the API server's
403 message for a refusal (`forbidden_message`). Aggregated ClusterRoles and nonResourceURLs are not emulated.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, NamedTuple

_WATCH = re.compile(r"(^|&)watch=(true|1)(&|$)", re.I)


class RequestAttributes(NamedTuple):
    verb: str
    group: str  # "" for the core group
    resource: str
    subresource: str  # "" for none
    namespace: str  # "" for the cluster scope (a cluster-scoped resource, or a namespaced one in all namespaces)
    name: str  # "" for a collection

    def scope(self) -> str:
        return f'in the namespace "{self.namespace}"' if self.namespace else "at the cluster scope"

    def resource_path(self) -> str:
        """"pods/log", "jobs": as an RBAC rule's resources name it."""
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def request_attributes(method: str, path: str, query: str = "") -> RequestAttributes | None:
    """The RBAC attributes of an API request (None: not a resource request, e.g. /version). As the API server's
    RequestInfoFactory: GET of one object is get, of a collection list, with watch=true watch; POST create; PUT update;
    PATCH patch; DELETE of one object delete, of a collection deletecollection."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    namespace = ""
    if len(rest) >= 2 and rest[0] == "namespaces":
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in ("status", "finalize"):  # (else a Namespace itself, or its subresource)
            rest = rest[2:]
    if not rest:
        return None
    resource, name, sub = rest[0], rest[1] if len(rest) > 1 else "", rest[2] if len(rest) > 2 else ""
    method = method.upper()
    if method == "GET":
        verb = "watch" if _WATCH.search(query) else ("get" if name else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())
    return RequestAttributes(verb, group, resource, sub, namespace, name)


def rule_allows(rule: dict, a: RequestAttributes) -> bool:
    """Whether one PolicyRule allows the request (Kubernetes' RuleAllows: verb, group, resource[/subresource] and, when
    the rule names some, the object's name)."""
    verbs, groups, resources = rule.get("verbs") or [], rule.get("apiGroups") or [], rule.get("resources") or []
    if not ("*" in verbs or a.verb in verbs) or not ("*" in groups or a.group in groups):
        return False
    if not ("*" in resources or a.resource_path() in resources or (a.subresource and f"*/{a.subresource}" in resources)):
        return False
    names = rule.get("resourceNames") or []
    return not names or a.name in names


def service_account_user(namespace: str, name: str) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def _groups(user: str) -> set[str]:
    groups = {"system:authenticated"}
    if user.startswith("system:serviceaccount:"):
        groups |= {"system:serviceaccounts", f"system:serviceaccounts:{user.split(':')[2]}"}
    return groups


class RbacError(ValueError):
    """A manifest the emulator's RBAC cannot read (names the document and the field)."""


class Authorizer:
    """RBAC over a set of manifests (Role, ClusterRole, RoleBinding, ClusterRoleBinding; other kinds, such as the
    ServiceAccount, are ignored), as the API server's RBAC authorizer decides."""

    def __init__(self, docs: Iterable[dict[str, Any]]):
        self.roles: dict[tuple[str, str], list[dict]] = {}  # (namespace, name) -> rules; namespace "" for ClusterRoles
        self.bindings: list[tuple[str, tuple[str, str], list[dict]]] = []  # (namespace, role key, subjects)
        docs = [d for d in docs if d]
        for i, d in enumerate(docs):
            self._add(i, d)

    @staticmethod
    def _where(i: int, d: dict) -> str:
        return f"document {i + 1} ({d.get('kind')} {(d.get('metadata') or {}).get('name')!r})"

    def _add(self, i: int, d: dict) -> None:
        if not isinstance(d, dict):
            raise RbacError(f"document {i + 1}: a mapping (a Kubernetes object) is expected, got {type(d).__name__}")
        kind, md = d.get("kind"), d.get("metadata") or {}
        if kind not in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"):
            return
        if not md.get("name"):
            raise RbacError(f"{self._where(i, d)}: metadata.name is missing")
        ns = md.get("namespace") or ""
        if kind in ("Role", "RoleBinding") and not ns:
            raise RbacError(f"{self._where(i, d)}: metadata.namespace is missing (a {kind} is namespaced)")
        if kind in ("Role", "ClusterRole"):
            rules = d.get("rules") or []
            for j, r in enumerate(rules):
                for key in ("verbs", "apiGroups", "resources"):
                    if not isinstance(r.get(key), list) or not r[key]:
                        raise RbacError(f"{self._where(i, d)}: rules[{j}].{key} must be a non-empty list")
            self.roles[(ns if kind == "Role" else "", md["name"])] = rules
            return
        ref = d.get("roleRef") or {}
        if ref.get("kind") not in ("Role", "ClusterRole") or not ref.get("name"):
            raise RbacError(f"{self._where(i, d)}: roleRef must name a Role or ClusterRole (kind and name)")
        if kind == "ClusterRoleBinding" and ref["kind"] == "Role":
            raise RbacError(f"{self._where(i, d)}: a ClusterRoleBinding can only refer to a ClusterRole")
        key = (ns if ref["kind"] == "Role" else "", ref["name"])
        self.bindings.append((ns if kind == "RoleBinding" else "", key, list(d.get("subjects") or [])))

    def _subject_is(self, s: dict, user: str, binding_ns: str) -> bool:
        kind, name = s.get("kind"), s.get("name")
        if kind == "ServiceAccount":
            return user == service_account_user(s.get("namespace") or binding_ns, name or "")
        if kind == "User":
            return user == name
        return kind == "Group" and name in _groups(user)

    def rules_for(self, user: str, namespace: str) -> list[dict]:
        """The rules that apply to `user`'s requests in `namespace` ("": at the cluster scope)."""
        out: list[dict] = []
        for bns, key, subjects in self.bindings:
            if bns and bns != namespace:  # a RoleBinding grants in its own namespace only
                continue
            if any(self._subject_is(s, user, bns) for s in subjects):
                out.extend(self.roles.get(key, ()))  # (a binding to a missing role grants nothing, as RBAC)
        return out

    def allows(self, user: str, a: RequestAttributes) -> bool:
        return any(rule_allows(r, a) for r in self.rules_for(user, a.namespace))


def forbidden_message(user: str, a: RequestAttributes) -> str:
    """The API server's message for a request RBAC refused (its forbiddenMessage, wrapped by NewForbidden)."""
    qualified = f"{a.resource}.{a.group}" if a.group else a.resource
    what = f'{qualified} "{a.name}"' if a.name else qualified
    return f'{what} is forbidden: User "{user}" cannot {a.verb} resource "{a.resource_path()}" in API group "{a.group}" {a.scope()}'
