"""The commands that run the engine model over traces and workloads: replay (the main job), simulate, sweeps and the robustness table."""
