"""The Qt layer: widgets, and one worker thread that owns the engine. Nothing outside this package imports Qt."""
