"""Model families, registered by name. Importing this package registers the built-ins (no heavy imports)."""

from servopt.families import embedding, image, text  # noqa: F401
from servopt.families.base import FAMILIES, DataOptions, Family, Judgement, family_of, register_family

__all__ = ["FAMILIES", "DataOptions", "Family", "Judgement", "family_of", "register_family"]
