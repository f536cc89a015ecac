import this_module_does_not_exist_anywhere  # noqa: F401  (the point of this plugin)
