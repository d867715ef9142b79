"""Model families, registered by name. Importing this package registers the built-ins (no heavy imports)."""

from servopt.families import embedding, image, text  # noqa: F401
from servopt.families.base import FAMILIES, BoundCheck, DataOptions, Family, family_of, register_family

__all__ = ["FAMILIES", "BoundCheck", "DataOptions", "Family", "family_of", "register_family"]
