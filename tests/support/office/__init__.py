"""An emulated office on one machine (root only): PCs with their own network namespace, cores,
memory and display, people at their keyboards, and links between them. One module per part, so
later tests (a day of people coming and going) reuse them: :mod:`.share` (cgroups), :mod:`.display`
(Xvfb), :mod:`.pc`, :mod:`.person` (xdotool), :mod:`.link`, :mod:`.office` (the whole with a real
fleet service and agents), :mod:`.users` (openai clients run inside a PC)."""
