"""The planning wing, pure Python (no torch): the balance advisor, the memory and cost
models of a model's shape, the schedule optimiser, the profile reader and comparison, the
schedule catalog (torch's schedules imported only where asked for), reports and exports.
It imports the schedule layer; nothing of the plugin's core imports it. See
docs/advisor.md, docs/optimizer.md and docs/schedules.md."""
