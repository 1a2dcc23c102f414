"""Does the dataset a job names exist? Cloud Storage through the GCS client, local files on disk."""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

from api.settings import Settings


class DatasetUnavailable(Exception):
    """The dataset can't be used: the job fails with this code and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class StorageUnreachable(Exception):
    """Storage did not answer; the check is retried later (the job keeps waiting)."""


def split_gs_uri(uri: str) -> tuple[str, str]:
    bucket, _, name = uri.removeprefix("gs://").partition("/")
    return bucket, name


@lru_cache(maxsize=4)
def gcs_client(endpoint: str | None, project: str | None) -> Any:
    from google.cloud import storage

    if endpoint:
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(
            project=project or "tputune",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": endpoint},
        )
    return storage.Client(project=project)


def check_dataset(uri: str, settings: Settings, what: str = "dataset") -> None:
    if uri.startswith("gs://"):
        _check_gcs(uri, settings, what)
        return
    if not os.path.exists(uri):
        raise DatasetUnavailable(f"{what}_not_found", f"The {what} file {uri} does not exist on this server.")
    if not os.path.isfile(uri):
        raise DatasetUnavailable(f"{what}_not_found", f"The {what} path {uri} is not a file.")
    if not os.access(uri, os.R_OK):
        raise DatasetUnavailable(
            f"{what}_unreadable", f"The {what} file {uri} is not readable by the service."
        )
    if os.path.getsize(uri) == 0:
        raise DatasetUnavailable(f"{what}_empty", f"The {what} file {uri} is empty.")


def _check_gcs(uri: str, settings: Settings, what: str) -> None:
    from google.api_core import exceptions as gexc
    from google.cloud.storage.retry import DEFAULT_RETRY

    bucket_name, name = split_gs_uri(uri)
    try:
        client = gcs_client(settings.gcs_endpoint, settings.gcs_project)
        # Bounded: the default retry waits up to 2 minutes, and the dispatcher loop would wait with it.
        retry = DEFAULT_RETRY.with_timeout(settings.storage_timeout_seconds)
        blob = client.bucket(bucket_name).get_blob(
            name, timeout=settings.storage_timeout_seconds, retry=retry
        )
    except gexc.NotFound:
        raise DatasetUnavailable(
            f"{what}_not_found", f"The bucket of {uri} does not exist or is not visible to the service."
        ) from None
    except gexc.Forbidden:
        raise DatasetUnavailable(
            f"{what}_forbidden",
            f"The service's account may not read {uri}; grant it roles/storage.objectViewer on the bucket.",
        ) from None
    except Exception as exc:  # network errors, 5xx, missing credentials: worth another try
        raise StorageUnreachable(f"Cloud Storage did not answer for {uri}: {type(exc).__name__}") from exc
    if blob is None:
        raise DatasetUnavailable(f"{what}_not_found", f"The {what} object {uri} does not exist.")
    if not blob.size:
        raise DatasetUnavailable(f"{what}_empty", f"The {what} object {uri} is empty.")
