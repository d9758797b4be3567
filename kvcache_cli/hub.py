"""Hugging Face Hub ids: a repository's config.json, as a local file, for `kvcache size`.

`config_json("Qwen/Qwen2.5-7B-Instruct")` returns the path of that repository's
config.json in the local Hub cache, downloading it first when the Hub can be reached.
huggingface_hub does the work, so HF_TOKEN, HF_HUB_OFFLINE, HF_HOME and HF_HUB_CACHE
mean what they mean for every other Hub tool. This module imports huggingface_hub
inside its functions: `kvcache size` pays for it only when it is given a Hub id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# An ORG/NAME repository id, as the Hub spells them (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")

# Long enough for a slow link, short enough that an offline user is told at once:
# without this probe the Hub client retries a dead connection for about 25 s.
HUB_TIMEOUT_S = 3.0


class HubError(ValueError):
    """The id, the revision, the token or the cache is wrong: the user can fix it."""


class HubUnavailable(RuntimeError):
    """The Hub answered with a failure that is not the user's (a server error)."""


@dataclass(frozen=True)
class HubConfig:
    """A Hub repository's config.json, on disk."""

    repo_id: str
    revision: str  # what was asked for: "main" unless --revision said otherwise
    commit: str  # the commit the file came from, from its snapshot folder
    path: str


def is_hub_id(name: str) -> bool:
    """Whether NAME is spelled like a Hub repository id (ORG/NAME), not a local path."""
    return _HUB_ID.match(name) is not None


def reachable(host: str, port: int = 443, timeout: float = HUB_TIMEOUT_S) -> bool:
    """Whether a TCP connection opens within `timeout` s (name lookup included)."""
    import socket  # here, as huggingface_hub: `size` with a preset needs neither
    import threading

    ok = threading.Event()

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.set()
        except OSError:
            pass

    # A thread, because getaddrinfo ignores socket timeouts and can hang on its own.
    threading.Thread(target=probe, daemon=True).start()
    return ok.wait(timeout)


def config_json(repo_id: str, revision: str | None = None) -> HubConfig:
    """REPO_ID's config.json at REVISION (default main) from the local Hub cache or the Hub."""
    try:
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub import errors as hub_errors
    except ImportError:
        raise HubError(
            f"reading {repo_id!r} from the Hugging Face Hub needs huggingface_hub, which is not "
            "installed: pip install 'kvcache[hub]', or pass --config PATH to a config.json"
        ) from None
    from urllib.parse import urlparse

    asked = revision or "main"
    at = f"{repo_id!r} at revision {asked!r}"
    no_network = ""
    if constants.HF_HUB_OFFLINE:
        no_network = "HF_HUB_OFFLINE is set"
    else:
        host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
        if not reachable(host):
            no_network = f"{host} is unreachable"
    try:
        path = hf_hub_download(
            repo_id, "config.json", revision=revision,
            local_files_only=bool(no_network), etag_timeout=HUB_TIMEOUT_S,
        )  # fmt: skip
    # Subclasses before their bases: a gated repo is a RepositoryNotFoundError too.
    except hub_errors.GatedRepoError:
        raise HubError(
            f"{repo_id!r} is gated: accept the licence and set HF_TOKEN (huggingface.co/{repo_id})"
        ) from None
    except hub_errors.RepositoryNotFoundError:
        raise HubError(
            f"no Hub repository {repo_id!r} (or it is private: set HF_TOKEN); expected an "
            "ORG/NAME id from huggingface.co or a preset (see 'kvcache models')"
        ) from None
    except hub_errors.RevisionNotFoundError:
        raise HubError(
            f"--revision {asked!r}: not a branch, tag or commit of {repo_id!r}"
        ) from None
    except hub_errors.LocalEntryNotFoundError:
        raise HubError(
            f"config.json of {at} is not in the local Hub cache and {no_network or 'the Hub'}"
            f"{'' if no_network else ' could not be reached'}: download it once online, "
            "or pass --config PATH to a config.json"
        ) from None
    except hub_errors.EntryNotFoundError:
        raise HubError(f"{at} has no config.json; expected a transformers model") from None
    except hub_errors.HFValidationError as error:
        raise HubError(f"--model {repo_id!r}: not a valid Hub id ({error})") from None
    except hub_errors.HfHubHTTPError as error:
        first = str(error).strip().splitlines()[0]
        raise HubUnavailable(f"the Hub failed to serve {at}: {first}") from None
    # Cached files live in .../snapshots/<commit>/config.json.
    commit = path.replace("\\", "/").rsplit("/", 2)[-2]
    return HubConfig(repo_id, asked, commit, path)
