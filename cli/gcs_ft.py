"""GcsFaultTolerance: the GCS keeps its state in Redis, so a head pod that dies comes back with
the cluster's state and the worker pods, with their replica groups, carry on serving.

Without it the head's loss is an outage: the GCS starts empty, every worker's raylet exits and
every replica group starts over. KubeRay's rules: the options go in the RayCluster spec
(`gcsFaultToleranceOptions`), never beside the `ray.io/ft-enabled` annotation, a
`redis-password` rayStartParam or a RAY_REDIS_ADDRESS / REDIS_PASSWORD variable of the head;
the password comes from a Secret. No `externalStorageNamespace`: KubeRay keys each cluster's
state by the RayCluster's uid, which keeps a RayService's old and new clusters apart in one
Redis during an upgrade.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tandem.cli.k8s import SecretRef

REDIS_IMAGE = "redis:7.4.0"  # the version of KubeRay's own external-Redis sample
REDIS_PORT = 6379
PASSWORD_KEY = "password"
_ADDRESS = re.compile(r"(rediss?://\S+|[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?:\d{1,5})")


@dataclass(frozen=True)
class GcsFaultTolerance:
    enabled: bool = True
    redis_address: str | None = None  # None: the manifest creates a Redis beside the cluster
    password: SecretRef | None = None  # None: the created Redis's Secret, <name>-redis:password

    def __post_init__(self) -> None:
        if not self.enabled and (self.redis_address is not None or self.password is not None):
            raise ValueError("no_gcs_fault_tolerance: takes no Redis (redis_address, redis_password_secret)")
        if self.redis_address is not None:
            if not _ADDRESS.fullmatch(self.redis_address):
                raise ValueError(f"redis_address: expected HOST:PORT (or a redis:// URI), got {self.redis_address!r}")
            if self.password is None:
                raise ValueError("redis_address: needs --redis-password-secret NAME[:KEY], the Secret holding "
                                 "that Redis's password")

    @property
    def creates_redis(self) -> bool:
        return self.enabled and self.redis_address is None

    def flags(self) -> list[str]:
        if not self.enabled:
            return ["--no-gcs-fault-tolerance"]
        flags = [] if self.redis_address is None else ["--redis-address", self.redis_address]
        return flags + ([] if self.password is None else ["--redis-password-secret", self.password.flag(PASSWORD_KEY)])

    def password_ref(self, name: str) -> SecretRef:
        return self.password or SecretRef(f"{name}-redis", PASSWORD_KEY)

    def options(self, name: str) -> dict[str, Any] | None:
        """The RayCluster spec's gcsFaultToleranceOptions (None when off)."""
        if not self.enabled:
            return None
        address = self.redis_address or f"{name}-redis:{REDIS_PORT}"
        return {"redisAddress": address, "redisPassword": self.password_ref(name).value_from()}

    def redis_objects(self, name: str) -> list[dict[str, Any]]:
        """The Redis the manifest creates: a Service and a one-pod StatefulSet with a claim for
        Redis's append-only file, so the GCS's state outlives a restart of Redis too. The
        password Secret is the operator's (deploy/README.md): a Secret in the manifest would
        put its placeholder back over the real password at every `kubectl apply`."""
        if not self.creates_redis:
            return []
        redis = f"{name}-redis"
        labels = {"app.kubernetes.io/name": "redis", "app.kubernetes.io/instance": redis,
                  "app.kubernetes.io/part-of": name}
        selector = {k: labels[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance")}
        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": redis, "labels": labels},
                   "spec": {"selector": selector, "ports": [{"name": "redis", "port": REDIS_PORT,
                                                             "targetPort": "redis"}]}}
        container = {
            "name": "redis", "image": REDIS_IMAGE,
            # The password reaches Redis from the Secret through the environment, never the manifest.
            "command": ["sh", "-c", f'exec redis-server --port {REDIS_PORT} --dir /data --appendonly yes '
                                    '--requirepass "$REDIS_PASSWORD"'],
            "env": [self.password_ref(name).env("REDIS_PASSWORD")],
            "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
            "readinessProbe": {"exec": {"command": ["sh", "-c",
                                                    'REDISCLI_AUTH="$REDIS_PASSWORD" redis-cli ping | grep -q PONG']},
                               "periodSeconds": 5},
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        }
        stateful_set = {
            "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": redis, "labels": labels},
            "spec": {
                "serviceName": redis, "replicas": 1, "selector": {"matchLabels": selector},
                "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
                "volumeClaimTemplates": [{"metadata": {"name": "data"},
                                          "spec": {"accessModes": ["ReadWriteOnce"],
                                                   "resources": {"requests": {"storage": "1Gi"}}}}],
            },
        }
        return [service, stateful_set]
