"""TieredConnector on Ray Serve LLM: the Serve config of the P/D app on CPU (`serve_pd_cpu.yaml`), the
KubeRay RayService template whose serveConfigV2 is that config (`rayservice.yaml`), its GPU overlay
(`rayservice_gpu_overlay.yaml`) and `manifests`, which renders either variant. See README.md."""
