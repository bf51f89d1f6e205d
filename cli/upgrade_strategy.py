"""UpgradeStrategy: what KubeRay does when `kubectl apply` changes the cluster's spec (image,
pods, flags). A change of the Serve config alone (serveConfigV2) is applied in place under
every strategy: Serve replaces the replica groups on the running cluster.

RayService (kuberay#1476, #4239):
  NewCluster (default)   a second cluster of the new spec starts, and traffic moves to it once
                         its application runs: no downtime, but twice the GPUs for the
                         upgrade; where they are missing the new cluster's pods stay Pending,
                         the upgrade waits and the old cluster serves on.
  NewClusterWithIncrementalUpgrade
                         the new cluster grows one replica group's share at a time as the old
                         one shrinks, traffic split by a Gateway API HTTPRoute: one group's
                         GPUs beyond the layout's. Needs the Gateway API CRDs, a Gateway
                         controller and its GatewayClass (--gateway-class), and Ray's autoscaler
                         (turned on, the GPU pods then come and go with the groups). HTTP only:
                         gRPC clients stay on the Serve Service.
  None                   a changed cluster spec is not rolled out: delete and apply again
                         (downtime) to change the image or the pods.
RayCluster:
  Recreate (default)     every pod is recreated with the new spec (running work ends).
  None                   running pods keep their spec; only new pods take the new one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tandem.cli.k8s import check_name

STRATEGIES = {"rayservice": ("NewCluster", "NewClusterWithIncrementalUpgrade", "None"),
              "raycluster": ("Recreate", "None")}
DEFAULT_STRATEGY = {"rayservice": "NewCluster", "raycluster": "Recreate"}
INCREMENTAL = "NewClusterWithIncrementalUpgrade"
DEFAULT_INTERVAL_S = 60


@dataclass(frozen=True)
class UpgradeStrategy:
    kind: str = "rayservice"
    type: str | None = None  # None: the kind's default
    gateway_class: str | None = None  # the incremental upgrade's GatewayClass
    interval_s: int = DEFAULT_INTERVAL_S  # between two traffic steps of the incremental upgrade
    step_percent: int | None = None  # None: one replica group's share of the traffic

    def __post_init__(self) -> None:
        if self.kind not in STRATEGIES:
            raise ValueError(f"kind: must be rayservice or raycluster, got {self.kind!r}")
        if self.type is not None and self.type not in STRATEGIES[self.kind]:
            raise ValueError(f"upgrade_strategy: a {self.kind} takes one of {', '.join(STRATEGIES[self.kind])}, "
                             f"got {self.type!r}")
        if self.is_incremental:
            if self.gateway_class is None:
                raise ValueError(f"upgrade_strategy {INCREMENTAL}: needs --gateway-class, the GatewayClass "
                                 "of the cluster's Gateway API controller")
            check_name("gateway_class", self.gateway_class)
            if self.interval_s < 1:
                raise ValueError(f"upgrade_interval_s: must be at least 1, got {self.interval_s}")
            if self.step_percent is not None and not 1 <= self.step_percent <= 100:
                raise ValueError(f"upgrade_step_percent: must be 1 to 100, got {self.step_percent}")
        elif (self.gateway_class, self.interval_s, self.step_percent) != (None, DEFAULT_INTERVAL_S, None):
            raise ValueError(f"gateway_class, upgrade_interval_s, upgrade_step_percent: only with {INCREMENTAL}")

    @property
    def resolved_type(self) -> str:
        return self.type or DEFAULT_STRATEGY[self.kind]

    @property
    def is_incremental(self) -> bool:
        return self.resolved_type == INCREMENTAL

    def flags(self) -> list[str]:
        if self.type is None:
            return []
        flags = ["--upgrade-strategy", self.type]
        if self.gateway_class is not None:
            flags += ["--gateway-class", self.gateway_class]
        if self.interval_s != DEFAULT_INTERVAL_S:
            flags += ["--upgrade-interval-s", str(self.interval_s)]
        return flags + ([] if self.step_percent is None else ["--upgrade-step-percent", str(self.step_percent)])

    def spec(self, num_replicas: int) -> dict[str, Any]:
        """The manifest's upgradeStrategy. The incremental upgrade moves capacity and traffic in
        steps of one group: Serve rounds a target capacity to whole replicas (at least one), so a
        smaller step would still start a whole group, and a larger one more GPUs at once."""
        strategy: dict[str, Any] = {"type": self.resolved_type}
        if self.is_incremental:
            step = self.step_percent or math.ceil(100 / num_replicas)
            strategy["clusterUpgradeOptions"] = {"gatewayClassName": self.gateway_class, "maxSurgePercent": step,
                                                 "stepSizePercent": step, "intervalSeconds": self.interval_s}
        return strategy
