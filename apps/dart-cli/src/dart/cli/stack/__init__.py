"""Running DART: one config file composing the four services, `dart run` and `dart serve`."""
