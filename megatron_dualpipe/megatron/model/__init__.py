"""Model room: placement, chunks, specs, tied and named params; imports compat/ only."""
