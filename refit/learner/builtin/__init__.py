"""The embedded tasks and models, built locally (nothing downloaded): refit demo, the distillation pair, the
geometries."""
