"""What a rank sees of itself and its peers: snapshots of its state and story, liveness of its peers,
the backend's clocks and flight recorder, progress evidence, stragglers; pure detectors over them."""
