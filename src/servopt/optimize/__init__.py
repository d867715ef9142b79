"""``servopt optimize``: variants, targets, decisions, reports (see ``runner``)."""
