"""Images: a name users know (``docker://``, ``oci:``, ``oci-archive:``, ``docker-archive:``) resolved
to a root file system on this node, fetched and unpacked once per digest (``cache.ImageCache``)."""

from __future__ import annotations

import functools

from rollout_service.images.cache import ImageCache, Rootfs
from rollout_service.images.refs import ImageRef, instance_image_name, parse_image
from rollout_service.settings import get_settings

__all__ = ["ImageCache", "ImageRef", "Rootfs", "image_cache", "instance_image_name", "parse_image", "resolve"]


@functools.lru_cache(maxsize=1)
def image_cache() -> ImageCache:
    settings = get_settings()
    return ImageCache(
        settings.image_cache_path,
        int(settings.image_cache_max_gb * 1024**3),
        settings.image_starts_per_node,
        settings.image_pull_timeout_s,
    )


def resolve(image: str) -> Rootfs:
    """``image``'s root file system on this node (fetched and unpacked first if it is not here)."""
    return image_cache().resolve(parse_image(image))
