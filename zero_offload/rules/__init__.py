"""Update rules: the arithmetic of each optimizer zero_offload offloads (see :mod:`zero_offload.rules.base`)."""
