"""Image names as users write them: the containers-transports names (``docker://REF``,
``oci:DIR[:TAG]``, ``oci-archive:FILE[:TAG]``, ``docker-archive:FILE[:REF]``) and a Singularity
``.sif`` file. A local image is read only from a directory the operator allows (state_dir/images,
ROLLOUT_IMAGE_ROOTS): a job must not make a worker read host files."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from rollout_service.errors import ValidationError
from rollout_service.settings import get_settings

LOCAL_TRANSPORTS = ("oci", "oci-archive", "docker-archive")
TRANSPORTS = ("docker", *LOCAL_TRANSPORTS, "sif")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_DOCKER_REF = re.compile(r"[a-z0-9]+(?:[._/-]+[a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


@dataclass(frozen=True)
class ImageRef:
    transport: str  # docker | oci | oci-archive | docker-archive | sif
    location: str  # docker: the registry reference; else an absolute path (resolved)
    tag: str = ""  # oci/oci-archive: the tag; docker-archive: the image in the archive
    pinned_digest: str = ""  # docker://REF@sha256:...: what the manifest must hash to

    @property
    def name(self) -> str:
        """The name for skopeo (and for messages)."""
        if self.transport == "docker":
            return f"docker://{self.location}"
        if self.transport == "sif":
            return self.location
        return f"{self.transport}:{self.location}" + (f":{self.tag}" if self.tag else "")

    @property
    def is_local(self) -> bool:
        return self.transport != "docker"


def parse_image(ref: str, field: str = "task.image") -> ImageRef:
    """``ref`` checked and resolved; a ValidationError naming ``field`` says what is wrong."""
    if not isinstance(ref, str) or not ref.strip():
        raise ValidationError(f"{field} must be a non-empty string such as docker://REF or oci:DIR:TAG")
    ref = ref.strip()
    if ref.startswith("docker://"):
        return _docker(ref[len("docker://") :], field)
    transport, sep, rest = ref.partition(":")
    if sep and transport in LOCAL_TRANSPORTS:
        path, _, tag = rest.partition(":")
        if tag and not _TAG.fullmatch(tag) and transport != "docker-archive":
            raise ValidationError(f"{field} {ref!r}: the tag {tag!r} is not a valid OCI tag")
        return ImageRef(transport, allowed_image_path(path, field), tag)
    if ref.endswith(".sif") and "://" not in ref:
        return ImageRef("sif", allowed_image_path(ref, field))
    known = ", ".join(["docker://REF", "oci:DIR[:TAG]", "oci-archive:FILE[:TAG]", "docker-archive:FILE", "FILE.sif"])
    raise ValidationError(f"{field} {ref!r} names no supported image transport; give one of {known}")


def _docker(reference: str, field: str) -> ImageRef:
    name, _, digest = reference.partition("@")
    if digest and not _DIGEST.fullmatch(digest):
        raise ValidationError(f"{field} docker://{reference}: {digest!r} is not a sha256:<64 hex digits> digest")
    repository, tag = name, ""
    if ":" in name.rsplit("/", 1)[-1]:
        repository, tag = name.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise ValidationError(f"{field} docker://{reference}: the tag {tag!r} is not a valid image tag")
    if not _DOCKER_REF.fullmatch(repository):
        raise ValidationError(f"{field} docker://{reference}: {repository!r} is not a valid image name (lower case)")
    return ImageRef("docker", reference, pinned_digest=digest)


def allowed_image_path(path: str, field: str = "task.image") -> str:
    """``path`` resolved, if it is absolute and under a directory local images may be read from."""
    if not os.path.isabs(path):
        raise ValidationError(f"{field}: the image path {path!r} must be absolute")
    resolved = os.path.realpath(path)
    roots = get_settings().image_root_paths
    if not any(resolved == root or resolved.startswith(root.rstrip("/") + "/") for root in roots):
        raise ValidationError(
            f"{field}: the image path {path}{f' (resolved: {resolved})' if resolved != path else ''} is outside the "
            f"directories images may be read from ({', '.join(roots)}); put the image under one of them, or have "
            "the operator add its directory to ROLLOUT_IMAGE_ROOTS"
        )
    return resolved


def instance_image_name(template: str, instance_id: str) -> str:
    """A SWE-bench instance's image from a template (``{instance_id}``: the id with ``__`` written
    ``_1776_`` and lower-cased, as the SWE-bench harness names its images; ``{raw_instance_id}``: as is)."""
    safe = instance_id.replace("__", "_1776_").lower()
    try:
        return template.format(instance_id=safe, raw_instance_id=instance_id)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValidationError(
            f"ROLLOUT_SWE_IMAGE_TEMPLATE {template!r} is not a valid template ({exc}); use {{instance_id}}"
        ) from None
