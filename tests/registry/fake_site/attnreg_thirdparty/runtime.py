"""The runtime module of attnreg_thirdparty: it defines no ``GhostBackend``."""


class SomethingElse:
    pass
