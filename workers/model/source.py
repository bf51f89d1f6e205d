"""Where a model's files come from: a model reference resolved to a directory on this node.

A reference (the `model`, `tokenizer` and `speculative_model` options) is one of:
  - a local directory, read where it is (at the same path on every node that reads it);
  - a Hugging Face repo id, `org/name`, at a `revision` (a branch, tag or commit; default: main),
    fetched by huggingface_hub into its cache (HF_HUB_CACHE) from HF_ENDPOINT with HF_TOKEN: the
    cache holds one copy per node, huggingface_hub locks each file while it downloads it, and
    with HF_HUB_OFFLINE set the cached copy is used as it is;
  - `s3://bucket/prefix` (boto3: AWS_ENDPOINT_URL or AWS_ENDPOINT_URL_S3, and boto3's chain of
    credentials) or `gs://bucket/prefix` (google-cloud-storage: STORAGE_EMULATOR_HOST, and
    Google's default credentials), fetched into $TANDEM_MODEL_CACHE/<scheme>/<bucket>/<prefix>
    (default: the `models` folder of tandem's cache dir, ~/.cache/tandem/models) once per node:
    one process fetches under a file lock while the others wait for it, each file lands under a
    temporary name and is renamed into place, and a marker written after the last one says the
    copy is complete, so a fetch cut short is finished by the next one, never read as whole.

Every process that reads a model (the ingress, a group, each of its workers) resolves the
reference on its own node and fetches only what it reads: the configs and tokenizer files for
the config and the tokenizer, the safetensors files and their index for the weights. A repo's
.bin/.pt copies of the same weights and its subfolders are never fetched. A bucket's copy is not
refreshed: a new version of a model goes under a new prefix.

`check_model_sources` asks each source whether its model is there (its config.json, a
tokenizer's files) without fetching it: `build_app` refuses a missing or unreadable model before
anything starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.workers.cache_dir import cache_dir
from tandem.workers.config import MODEL_URI_SCHEMES

if TYPE_CHECKING:
    from tandem.workers.config import EngineConfig

logger = logging.getLogger(__name__)

# What the engine reads beside the weights: the model's two configs and AutoTokenizer's files.
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                  "chat_template.jinja", "chat_template.json")
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")
MODEL_NEEDS = ("config.json",)  # a model is there when its config is
TOKENIZER_NEEDS = ("tokenizer_config.json", "tokenizer.json")  # a tokenizer, when one of these is
# The Hub's repo names: letters, digits, "-", "_" and ".", not starting with "-" or ".".
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_COMPLETE = {False: ".tandem-metadata-complete", True: ".tandem-weights-complete"}


def resolve_model(reference: str, revision: str | None = None, *, weights: bool = True,
                  what: str = "model", needs: tuple[str, ...] = MODEL_NEEDS) -> str:
    """The local directory of `reference` on this node, fetched first if it is remote: with
    the weights, or (weights=False) only the configs and tokenizer files."""
    uri = BucketURI.parse(reference, what)
    if uri is not None:
        return str(_fetch_bucket(uri, weights, what, needs))
    if not is_hub_repo(reference):
        _refuse_revision(reference, revision)
        return reference
    return _fetch_hub(reference, revision, weights, what, needs)


def tokenizer_dir(model: str, tokenizer: str | None = None, revision: str | None = None) -> str:
    """The local directory of the tokenizer a model is served with: `tokenizer`'s when given,
    else the model's (at `revision`, which is the model's alone)."""
    if tokenizer is None or tokenizer == model:
        return resolve_model(model, revision, weights=False)
    return resolve_model(tokenizer, weights=False, what="tokenizer", needs=TOKENIZER_NEEDS)


def is_hub_repo(reference: str) -> bool:
    """Whether a reference names a Hub repo: `org/name`, and no directory of that name here."""
    return _REPO_ID.fullmatch(reference) is not None and not os.path.isdir(reference)


def model_cache_dir() -> Path:
    """Where bucket models are fetched to: $TANDEM_MODEL_CACHE, else <tandem's cache dir>/models."""
    return Path(os.environ.get("TANDEM_MODEL_CACHE") or cache_dir() / "models")


# ---- the early check ----------------------------------------------------------------------------------
def check_model_sources(config: EngineConfig) -> None:
    """ValueError naming the reason unless the model, tokenizer and draft an engine's options
    name are there and readable; fetches nothing."""
    model = config.model
    if model.model is not None:
        check_model_source(model.model, model.revision)
    if model.tokenizer is not None and model.tokenizer != model.model:
        check_model_source(model.tokenizer, what="tokenizer", needs=TOKENIZER_NEEDS)
    draft = config.speculative.speculative_model
    if draft is not None and draft != "ngram":
        check_model_source(draft, what="speculative_model")


def check_model_source(reference: str, revision: str | None = None, *, what: str = "model",
                       needs: tuple[str, ...] = MODEL_NEEDS) -> None:
    """ValueError("<what>: <reason>") unless `reference` holds one of `needs` (config.json):
    a local directory is read, the Hub and buckets are asked; nothing is fetched."""
    uri = BucketURI.parse(reference, what)
    if uri is not None:
        names = {obj.name for obj in bucket_store(uri, what).list(uri)}
        if not names:
            raise ValueError(f"{what}: nothing under {uri} (or no access to it)")
        if not names & set(needs):
            raise ValueError(f"{what}: no {' or '.join(needs)} under {uri}")
    elif is_hub_repo(reference):
        _check_hub(reference, revision, what, needs)
    else:
        _refuse_revision(reference, revision)
        if not os.path.isdir(reference):
            raise ValueError(f"{what}: {reference!r} is no directory here, nor a Hugging Face repo id (org/name), "
                             f"nor an s3:// or gs:// URI")
        found = [name for name in needs if os.path.isfile(os.path.join(reference, name))]
        if not found:
            raise ValueError(f"{what}: no {' or '.join(needs)} in {reference!r}")
        if not os.access(os.path.join(reference, found[0]), os.R_OK):
            raise ValueError(f"{what}: cannot read {os.path.join(reference, found[0])!r} (permissions)")


def _refuse_revision(reference: str, revision: str | None) -> None:
    if revision is not None:
        raise ValueError(f"revision: {reference!r} is a local directory, which has no revisions "
                         f"(a revision names a version of a Hub repo)")


# ---- the Hugging Face Hub -------------------------------------------------------------------------------
def _hub_options() -> dict[str, Any]:
    """huggingface_hub's endpoint, cache and token as the environment says now: it reads them once,
    at import, and a process may have set them since (a test, Ray's runtime_env)."""
    return {"endpoint": os.environ.get("HF_ENDPOINT") or None, "token": os.environ.get("HF_TOKEN") or None}


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def _fetch_hub(repo_id: str, revision: str | None, weights: bool, what: str, needs: tuple[str, ...]) -> str:
    from huggingface_hub import snapshot_download

    patterns = METADATA_FILES + (WEIGHT_FILES if weights else ())
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns),
                                 ignore_patterns=["*/*"],  # subfolders: other formats, other models
                                 cache_dir=os.environ.get("HF_HUB_CACHE") or None, **_hub_options())
    except Exception as exc:  # the Hub's refusals, and no cached copy when it cannot be reached
        raise ValueError(f"{what}: cannot fetch {repo_id!r} at {revision or 'main'} from {_hub_endpoint()}: "
                         f"{_hub_reason(exc, revision)}") from exc
    if not any(os.path.isfile(os.path.join(path, name)) for name in needs):
        raise ValueError(f"{what}: the Hub repo {repo_id!r} at {revision or 'main'} has no {' or '.join(needs)}")
    return path


def _check_hub(repo_id: str, revision: str | None, what: str, needs: tuple[str, ...]) -> None:
    from huggingface_hub import HfApi, constants

    where = f"{repo_id!r} at {revision or 'main'}"
    if constants.is_offline_mode():  # no asking: the cached copy is what there is
        try:
            _fetch_hub(repo_id, revision, False, what, needs)
        except ValueError as exc:
            raise ValueError(f"{what}: HF_HUB_OFFLINE is set and {where} is not in the Hugging Face cache "
                             f"({exc})") from exc
        return
    api = HfApi(**_hub_options())
    try:
        info = api.repo_info(repo_id, revision=revision)
        # The commit the revision names: a branch moving under the check cannot mix two answers.
        found = [name for name in needs if api.file_exists(repo_id, name, revision=info.sha or revision)]
    except Exception as exc:  # the Hub's refusals, and httpx's errors when it cannot be reached
        raise ValueError(f"{what}: cannot find {where} on {_hub_endpoint()}: {_hub_reason(exc, revision)}") from exc
    if not found:
        raise ValueError(f"{what}: the Hub repo {where} has no {' or '.join(needs)}")


def _hub_reason(exc: Exception, revision: str | None) -> str:
    """huggingface_hub's error as one line that says what to do about it."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(exc, RevisionNotFoundError):
        return f"the repo has no revision {revision!r}"
    if isinstance(exc, GatedRepoError):
        return "the repo is gated: HF_TOKEN must be a token of an account granted access"
    if isinstance(exc, RepositoryNotFoundError):
        return "no such repo (or it is private or gated, and HF_TOKEN does not grant access)"
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


# ---- buckets ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BucketURI:
    scheme: str  # s3 | gs
    bucket: str
    prefix: str  # without leading or trailing "/"; "" = the bucket's top

    @staticmethod
    def parse(reference: str, what: str = "model") -> BucketURI | None:
        """The URI `reference` is, or None when it is not one."""
        scheme, sep, rest = reference.partition("://")
        if not sep or scheme not in MODEL_URI_SCHEMES:
            return None
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        parts = prefix.split("/") if prefix else []
        # The prefix becomes a path under the cache: none of its parts may climb out of it.
        if not bucket or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"{what}: {reference!r} is not a {scheme}://bucket/prefix URI")
        return BucketURI(scheme, bucket, prefix)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}"

    @property
    def key_prefix(self) -> str:
        """What the keys of the files directly under this prefix start with."""
        return f"{self.prefix}/" if self.prefix else ""

    def cache_dir(self) -> Path:
        base = model_cache_dir() / self.scheme / self.bucket
        return base / self.prefix if self.prefix else base


@dataclass(frozen=True)
class BucketObject:
    name: str  # below the prefix
    key: str  # in the bucket
    size: int


class S3Store:
    """S3 through boto3, whose client finds the endpoint (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL)
    and the credentials (environment, profile, instance role) the usual way."""

    def __init__(self, what: str) -> None:
        try:
            import boto3
            from botocore.exceptions import BotoCoreError, ClientError
        except ImportError as exc:
            raise ValueError(f"{what}: s3:// models need boto3 (pip install 'tandem[s3]')") from exc
        self.what = what
        self.errors = (BotoCoreError, ClientError)
        self.client = boto3.client("s3")

    def list(self, uri: BucketURI) -> list[BucketObject]:
        start = uri.key_prefix
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=uri.bucket, Prefix=start,
                                                                           Delimiter="/")
            return [BucketObject(item["Key"][len(start):], item["Key"], item["Size"])
                    for page in pages for item in page.get("Contents", [])]
        except self.errors as exc:
            raise ValueError(f"{self.what}: cannot list {uri}: {exc}") from exc

    def download(self, uri: BucketURI, obj: BucketObject, path: str) -> None:
        try:
            self.client.download_file(uri.bucket, obj.key, path)
        except self.errors as exc:
            raise ValueError(f"{self.what}: cannot fetch s3://{uri.bucket}/{obj.key}: {exc}") from exc


class GCSStore:
    """Google Cloud Storage through google-cloud-storage, which takes STORAGE_EMULATOR_HOST (with
    anonymous credentials) or Google's default credentials."""

    def __init__(self, what: str) -> None:
        try:
            from google.api_core.exceptions import GoogleAPIError
            from google.auth.exceptions import GoogleAuthError
            from google.cloud import storage
        except ImportError as exc:
            raise ValueError(f"{what}: gs:// models need google-cloud-storage "
                             f"(pip install 'tandem[gcs]')") from exc
        self.what = what
        self.errors = (GoogleAPIError, GoogleAuthError)
        try:
            self.client = storage.Client()
        except self.errors as exc:
            raise ValueError(f"{what}: cannot open Google Cloud Storage: {exc}") from exc

    def list(self, uri: BucketURI) -> list[BucketObject]:
        start = uri.key_prefix
        try:
            return [BucketObject(blob.name[len(start):], blob.name, blob.size)
                    for blob in self.client.list_blobs(uri.bucket, prefix=start, delimiter="/")]
        except self.errors as exc:
            raise ValueError(f"{self.what}: cannot list {uri}: {exc}") from exc

    def download(self, uri: BucketURI, obj: BucketObject, path: str) -> None:
        try:
            self.client.bucket(uri.bucket).blob(obj.key).download_to_filename(path)
        except self.errors as exc:
            raise ValueError(f"{self.what}: cannot fetch gs://{uri.bucket}/{obj.key}: {exc}") from exc


def bucket_store(uri: BucketURI, what: str = "model") -> S3Store | GCSStore:
    return S3Store(what) if uri.scheme == "s3" else GCSStore(what)


def _fetch_bucket(uri: BucketURI, weights: bool, what: str, needs: tuple[str, ...]) -> Path:
    target = uri.cache_dir()
    if _complete(target, weights):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if _complete(target, weights):  # fetched by another process while this one waited
            return target
        store = bucket_store(uri, what)
        objects = [obj for obj in store.list(uri) if wanted(obj.name, weights)]
        if not {obj.name for obj in objects} & set(needs):
            raise ValueError(f"{what}: no {' or '.join(needs)} under {uri}")
        target.mkdir(parents=True, exist_ok=True)
        # Files a fetch cut short had renamed into place are whole: only the rest comes down.
        missing = [obj for obj in objects if not _have(target / obj.name, obj.size)]
        logger.info("%s: fetching %d of %d files (%.1f MB) into %s", uri, len(missing), len(objects),
                    sum(obj.size for obj in missing) / 1e6, target)
        for obj in missing:
            fd, part = tempfile.mkstemp(dir=target, prefix=f".{obj.name}.", suffix=".part")
            os.close(fd)
            try:
                store.download(uri, obj, part)
                os.chmod(part, 0o644)  # mkstemp makes it private; the other users of the node read it too
                os.replace(part, target / obj.name)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)
        (target / _COMPLETE[weights]).write_text("".join(f"{obj.name}\n" for obj in objects))
    return target


def wanted(name: str, weights: bool) -> bool:
    """Whether the engine reads a model's file `name` (with the weights, or without them)."""
    patterns = METADATA_FILES + (WEIGHT_FILES if weights else ())
    return "/" not in name and any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _complete(target: Path, weights: bool) -> bool:
    # A fetch with the weights fetched the rest too.
    return (target / _COMPLETE[True]).is_file() or (not weights and (target / _COMPLETE[False]).is_file())


def _have(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` for this block: one holder per node, others wait. flock's
    lock goes with the open file, so threads and processes alike wait, and a holder that dies
    releases it."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
