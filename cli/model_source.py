"""ModelSource: where the pods find the model, and the volumes and environment that takes.

    --model (none)          the built-in demo model: nothing to mount
    --model /abs/path       a directory at that path in every pod (in the image, or with
                            --model-pvc CLAIM a PersistentVolumeClaim mounted read-only at the
                            path's parent); with --model-pvc a relative path is a directory
                            of the claim, mounted at /models
    --model org/name        a Hugging Face repo id, or an s3:// or gs:// URI: every pod
                            downloads what it reads into the engine's caches (HF_HOME,
                            TANDEM_MODEL_CACHE) on one volume at /cache: an emptyDir, or
                            --cache-pvc CLAIM that the pods share and that outlives them;
                            --hf-token-secret NAME[:KEY] sets HF_TOKEN (gated repos). A bucket's
                            credentials are the cloud's (workload identity): not set here
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any

from tandem.cli.k8s import SecretRef, check_name

MODELS_MOUNT = "/models"  # where --model-pvc goes when --model is relative
CACHE_MOUNT = "/cache"
# The engine's two caches (workers/model/source.py): huggingface_hub's for repos, tandem's for buckets.
CACHE_ENV = {"HF_HOME": f"{CACHE_MOUNT}/huggingface", "TANDEM_MODEL_CACHE": f"{CACHE_MOUNT}/tandem/models"}
HF_TOKEN_KEY = "token"
# The image's user (rayproject/ray: ray, group users = 100) writes the cache; a claim's files
# take that group when mounted.
IMAGE_GID = 100
REMOTE_SCHEMES = ("s3://", "gs://")
# The Hub's repo ids as the engine reads them (workers/model/source.py): org/name.
_HF_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


@dataclass(frozen=True)
class ModelSource:
    model: str | None = None
    model_pvc: str | None = None
    cache_pvc: str | None = None
    hf_token: SecretRef | None = None

    def __post_init__(self) -> None:
        for what, claim in (("model_pvc", self.model_pvc), ("cache_pvc", self.cache_pvc)):
            if claim is not None:
                check_name(what, claim)
        if self.model_pvc is not None:
            if self.model is None or self.model.startswith(REMOTE_SCHEMES):
                raise ValueError(f"model_pvc: needs a model directory of the claim as the model (an absolute path, "
                                 f"or one relative to {MODELS_MOUNT}), got {self.model!r}")
            if self.claim_mount == "/":
                raise ValueError(f"model_pvc: the claim mounts at the model's parent, and {self.model!r} has "
                                 "none but /: put the model one directory deeper")
            if ".." in self.model.split("/"):
                raise ValueError(f"model: {self.model!r} leaves the claim (..)")
        elif self.model is not None and not self.model.startswith(("/", *REMOTE_SCHEMES)) \
                and not _HF_REPO_ID.fullmatch(self.model):
            raise ValueError(f"model: {self.model!r} is none of an absolute path, a Hugging Face repo id "
                             "(org/name) or an s3:// / gs:// URI")
        if not self.is_downloaded and (self.cache_pvc is not None or self.hf_token is not None):
            raise ValueError("cache_pvc and hf_token_secret: only for a model the pods download (a Hugging Face "
                             "repo id or an s3:// / gs:// URI)")

    @property
    def is_downloaded(self) -> bool:
        """Every node fetches the model (a Hugging Face repo id or a URI) rather than finding it on a path."""
        return self.model is not None and self.model_pvc is None and not self.model.startswith("/")

    @property
    def app_model(self) -> str | None:
        """The application's `model` argument: the path in the pods, or the repo id / URI."""
        if self.model_pvc is not None:
            return posixpath.normpath(posixpath.join(MODELS_MOUNT, self.model))  # an absolute model stays
        return self.model

    @property
    def claim_mount(self) -> str | None:
        """Where --model-pvc's root goes: the model's parent, or /models for a relative model."""
        if self.model_pvc is None:
            return None
        return posixpath.dirname(self.app_model) if self.model.startswith("/") else MODELS_MOUNT

    def flags(self) -> list[str]:
        flags = [] if self.model is None else ["--model", self.model]
        if self.model_pvc is not None:
            flags += ["--model-pvc", self.model_pvc]
        if self.cache_pvc is not None:
            flags += ["--cache-pvc", self.cache_pvc]
        if self.hf_token is not None:
            flags += ["--hf-token-secret", self.hf_token.flag(HF_TOKEN_KEY)]
        return flags

    def volumes(self) -> list[dict[str, Any]]:
        if self.model_pvc is not None:
            return [{"name": "model", "persistentVolumeClaim": {"claimName": self.model_pvc, "readOnly": True}}]
        if self.is_downloaded:
            if self.cache_pvc is not None:
                return [{"name": "model-cache", "persistentVolumeClaim": {"claimName": self.cache_pvc}}]
            return [{"name": "model-cache", "emptyDir": {}}]
        return []

    def volume_mounts(self) -> list[dict[str, Any]]:
        if self.model_pvc is not None:
            return [{"name": "model", "mountPath": self.claim_mount, "readOnly": True}]
        if self.is_downloaded:
            return [{"name": "model-cache", "mountPath": CACHE_MOUNT}]
        return []

    def env(self) -> list[dict[str, Any]]:
        if not self.is_downloaded:
            return []
        env = [{"name": k, "value": v} for k, v in CACHE_ENV.items()]
        return env + ([] if self.hf_token is None else [self.hf_token.env("HF_TOKEN")])

    def pod_security_context(self) -> dict[str, Any]:
        """A shared cache claim is written by the image's user: its files take the user's group,
        checked at the claim's root only (a full walk of a model cache on every mount is slow)."""
        if self.cache_pvc is None:
            return {}
        return {"fsGroup": IMAGE_GID, "fsGroupChangePolicy": "OnRootMismatch"}
