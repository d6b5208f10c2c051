"""What runs the model behind the frontend: the Backend protocol, the in-process backend,
the Ray backend with its worker pool, bootstrap, actor shells and the cluster daemon."""
