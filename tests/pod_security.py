"""The Kubernetes Pod Security Standard ``restricted``, one rule per control, for a pod template.

The controls and their allowed values are those of the Pod Security admission controller
(k8s.io/pod-security-admission, ``policy/check_*.go``): the ``baseline`` ones, which ``restricted``
includes, then the ``restricted`` ones. Each rule takes a pod template (``metadata`` and ``spec``)
and returns what breaks it, one line each; :func:`pod_security_errors` runs them all and names the
control in every line. Two differences from the admission controller, both stricter: the
relaxations for a pod in a user namespace (``hostUsers: false``) are not made (these pods do not
ask for one), and the safe sysctls are those of the oldest Kubernetes the chart supports.
Beside the profile, :data:`POD_RULES` holds this project's own: no service-account token (the
server never calls the Kubernetes API, so a token in the pod would only serve an intruder).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

Pod = dict[str, Any]  # a pod template: {"metadata": ..., "spec": ...}
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")
HOOKS = ("postStart", "preStop")
DEFAULT_CAPABILITIES = frozenset(
    {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
     "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
)  # fmt: skip
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t"})
ALLOWED_PROFILE_TYPES = frozenset({"RuntimeDefault", "Localhost"})
# Safe in every Kubernetes from 1.29 on (the admission controller's sysctlsAllowedV1Dot29).
SAFE_SYSCTLS = frozenset(
    {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_syncookies",
     "net.ipv4.ping_group_range", "net.ipv4.ip_unprivileged_port_start", "net.ipv4.ip_local_reserved_ports",
     "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
     "net.ipv4.tcp_keepalive_probes"}
)  # fmt: skip
RESTRICTED_VOLUME_SOURCES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image", "persistentVolumeClaim", "projected",
     "secret"}
)  # fmt: skip


def containers(pod: Pod) -> Iterator[dict[str, Any]]:
    for key in CONTAINER_LISTS:
        yield from pod["spec"].get(key, [])


def pod_context(pod: Pod) -> dict[str, Any]:
    return pod["spec"].get("securityContext") or {}


def context(container: dict[str, Any]) -> dict[str, Any]:
    return container.get("securityContext") or {}


def per_container(field: str, allowed: Callable[[Any], bool]) -> Callable[[Pod], list[str]]:
    """A rule on one field of each container's securityContext (absent: not checked)."""

    def rule(pod: Pod) -> list[str]:
        return [
            f"container {c['name']} sets securityContext.{field}={context(c)[field]!r}"
            for c in containers(pod)
            if field in context(c) and not allowed(context(c)[field])
        ]

    return rule


def pod_and_containers(field: str, allowed: Callable[[Any], bool], *, required: bool) -> Callable[[Pod], list[str]]:
    """A rule on a field the pod's securityContext sets for every container and a container's may
    override: each container's own value where set, else the pod's; ``required``: an unset one breaks it."""

    def rule(pod: Pod) -> list[str]:
        errors = []
        if field in pod_context(pod) and not allowed(pod_context(pod)[field]):
            errors.append(f"pod sets securityContext.{field}={pod_context(pod)[field]!r}")
        for c in containers(pod):
            if field in context(c):
                if not allowed(context(c)[field]):
                    errors.append(f"container {c['name']} sets securityContext.{field}={context(c)[field]!r}")
            elif required and field not in pod_context(pod):
                errors.append(f"neither the pod nor container {c['name']} sets securityContext.{field}")
        return errors

    return rule


def host_process(pod: Pod) -> list[str]:
    owners = [("pod", pod_context(pod))] + [(f"container {c['name']}", context(c)) for c in containers(pod)]
    return [f"{who} sets windowsOptions.hostProcess" for who, ctx in owners
            if (ctx.get("windowsOptions") or {}).get("hostProcess")]  # fmt: skip


def host_namespaces(pod: Pod) -> list[str]:
    return [f"spec.{key} is true" for key in ("hostNetwork", "hostPID", "hostIPC") if pod["spec"].get(key)]


def capabilities_baseline(pod: Pod) -> list[str]:
    return [
        f"container {c['name']} adds {cap}"
        for c in containers(pod)
        for cap in (context(c).get("capabilities") or {}).get("add", [])
        if cap not in DEFAULT_CAPABILITIES
    ]


def host_path_volumes(pod: Pod) -> list[str]:
    return [f"volume {v['name']} is a hostPath" for v in pod["spec"].get("volumes", []) if "hostPath" in v]


def host_ports(pod: Pod) -> list[str]:
    return [
        f"container {c['name']} port {p.get('name', p['containerPort'])} has hostPort {p['hostPort']}"
        for c in containers(pod)
        for p in c.get("ports", [])
        if p.get("hostPort")
    ]


def host_in_probes(pod: Pod) -> list[str]:
    """A probe or lifecycle hook aimed at another host (the kubelet would call it from the node)."""
    errors = []
    for c in containers(pod):
        handlers = {name: c.get(name) or {} for name in PROBES}
        handlers |= {f"lifecycle.{hook}": (c.get("lifecycle") or {}).get(hook) or {} for hook in HOOKS}
        for name, handler in handlers.items():
            for kind in ("httpGet", "tcpSocket"):
                if (handler.get(kind) or {}).get("host"):
                    errors.append(f"container {c['name']} {name}.{kind}.host is {handler[kind]['host']!r}")
    return errors


def apparmor(pod: Pod) -> list[str]:
    prefix = "container.apparmor.security.beta.kubernetes.io/"
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    errors = [
        f"annotation {key}: {value}"
        for key, value in annotations.items()
        if key.startswith(prefix) and value and value != "runtime/default" and not value.startswith("localhost/")
    ]
    check = pod_and_containers("appArmorProfile", lambda p: p.get("type") in ALLOWED_PROFILE_TYPES, required=False)
    return errors + check(pod)


def selinux(pod: Pod) -> list[str]:
    def allowed(options: dict[str, Any]) -> bool:
        return options.get("type", "") in SELINUX_TYPES and not options.get("user") and not options.get("role")

    return pod_and_containers("seLinuxOptions", allowed, required=False)(pod)


def sysctls(pod: Pod) -> list[str]:
    return [f"sysctl {s['name']} is not a safe one" for s in pod_context(pod).get("sysctls", [])
            if s["name"] not in SAFE_SYSCTLS]  # fmt: skip


def restricted_volumes(pod: Pod) -> list[str]:
    return [
        f"volume {v['name']} is a {kind}"
        for v in pod["spec"].get("volumes", [])
        for kind in sorted(v.keys() - {"name"} - RESTRICTED_VOLUME_SOURCES)
    ]


def capabilities_restricted(pod: Pod) -> list[str]:
    errors = []
    for c in containers(pod):
        caps = context(c).get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            errors.append(f"container {c['name']} does not drop ALL capabilities")
        errors += [f"container {c['name']} adds {cap}" for cap in caps.get("add", []) if cap != "NET_BIND_SERVICE"]
    return errors


def privilege_escalation(pod: Pod) -> list[str]:
    """``allowPrivilegeEscalation`` false in every container, said: its default is true."""
    errors = []
    for c in containers(pod):
        value = context(c).get("allowPrivilegeEscalation")
        if value is None:
            errors.append(f"container {c['name']} leaves securityContext.allowPrivilegeEscalation unset (true)")
        elif value is not False:
            errors.append(f"container {c['name']} sets securityContext.allowPrivilegeEscalation={value!r}")
    return errors


def service_account_token(pod: Pod) -> list[str]:
    """The API server mounts the token unless the pod (or its service account) says false: say it in the pod."""
    mounted = pod["spec"].get("automountServiceAccountToken")
    return [] if mounted is False else [f"automountServiceAccountToken is {mounted!r}, not false"]


BASELINE: dict[str, Callable[[Pod], list[str]]] = {
    "hostProcess": host_process,
    "host namespaces": host_namespaces,
    "privileged containers": per_container("privileged", lambda value: value is False),
    "capabilities (baseline)": capabilities_baseline,
    "hostPath volumes": host_path_volumes,
    "host ports": host_ports,
    "host probes and lifecycle hooks": host_in_probes,
    "AppArmor": apparmor,
    "SELinux": selinux,
    "/proc mount type": per_container("procMount", lambda value: value == "Default"),
    "seccomp (baseline)": pod_and_containers("seccompProfile", lambda p: p.get("type") != "Unconfined", required=False),
    "sysctls": sysctls,
}
RESTRICTED: dict[str, Callable[[Pod], list[str]]] = {
    "volume types": restricted_volumes,
    "privilege escalation": privilege_escalation,
    "running as non-root": pod_and_containers("runAsNonRoot", lambda value: value is True, required=True),
    "running as non-root user": pod_and_containers("runAsUser", lambda uid: uid != 0, required=False),
    "seccomp (restricted)": pod_and_containers(
        "seccompProfile", lambda p: p.get("type") in ALLOWED_PROFILE_TYPES, required=True
    ),
    "capabilities (restricted)": capabilities_restricted,
}
POD_RULES: dict[str, Callable[[Pod], list[str]]] = {"no service-account token": service_account_token}


CONTROLS = {**BASELINE, **RESTRICTED, **POD_RULES}


def pod_security_errors(where: str, pod: Pod) -> list[str]:
    """What in ``pod`` (a pod template) the ``restricted`` profile or :data:`POD_RULES` refuse, as
    ``"<where>: <control>: <what>"`` lines."""
    return [f"{where}: {control}: {error}" for control, rule in CONTROLS.items() for error in rule(pod)]


# -- broken variants: each breaks one control in a pod that passes them all ---------------------


def first_context(pod: Pod) -> dict[str, Any]:
    return pod["spec"]["containers"][0].setdefault("securityContext", {})


def dropped_everywhere(field: str) -> Callable[[Pod], None]:
    """A breaker that takes ``field`` out of the pod's securityContext and every container's."""

    def drop(pod: Pod) -> None:
        for ctx in (pod["spec"].get("securityContext") or {}, *map(context, containers(pod))):
            ctx.pop(field, None)

    return drop


def first_port(pod: Pod) -> dict[str, Any]:
    return pod["spec"]["containers"][0]["ports"][0]


BREAKERS: dict[str, Callable[[Pod], None]] = {
    "hostProcess": lambda pod: first_context(pod).update(windowsOptions={"hostProcess": True}),
    "host namespaces": lambda pod: pod["spec"].update(hostPID=True),
    "privileged containers": lambda pod: first_context(pod).update(privileged=True),
    "capabilities (baseline)": lambda pod: first_context(pod).update(
        capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    ),
    "hostPath volumes": lambda pod: pod["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/var/run"}}),
    "host ports": lambda pod: first_port(pod).update(hostPort=first_port(pod)["containerPort"]),
    # The cloud's metadata server, called by the kubelet from the node.
    "host probes and lifecycle hooks": lambda pod: pod["spec"]["containers"][0]["readinessProbe"]["httpGet"].update(
        host="169.254.169.254"
    ),
    "AppArmor": lambda pod: first_context(pod).update(appArmorProfile={"type": "Unconfined"}),
    "SELinux": lambda pod: first_context(pod).update(seLinuxOptions={"type": "spc_t"}),
    "/proc mount type": lambda pod: first_context(pod).update(procMount="Unmasked"),
    "seccomp (baseline)": lambda pod: first_context(pod).update(seccompProfile={"type": "Unconfined"}),
    "sysctls": lambda pod: (
        pod["spec"].setdefault("securityContext", {}).update(sysctls=[{"name": "kernel.msgmax", "value": "65536"}])
    ),
    "volume types": lambda pod: pod["spec"]["volumes"].append(
        {"name": "models", "nfs": {"server": "nfs.example.com", "path": "/models"}}
    ),
    # Left out, it is true.
    "privilege escalation": lambda pod: first_context(pod).pop("allowPrivilegeEscalation"),
    "running as non-root": dropped_everywhere("runAsNonRoot"),
    "running as non-root user": lambda pod: first_context(pod).update(runAsUser=0),
    # Allowed by baseline (the runtime's default may be none at all), not by restricted.
    "seccomp (restricted)": dropped_everywhere("seccompProfile"),
    "capabilities (restricted)": lambda pod: first_context(pod).update(capabilities={"drop": ["NET_RAW"]}),
    # Left out, the API server mounts the token.
    "no service-account token": lambda pod: pod["spec"].pop("automountServiceAccountToken"),
}
