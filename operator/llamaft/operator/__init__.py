"""The llamaft operator: kopf's registry (`handlers`) handing off to modules with one job each
(`daemon`, `step`, `children`, `spec_changes`, `deletion`, `startup`), over pure decisions
(`lifecycle`, `observe`, `failures`)."""
