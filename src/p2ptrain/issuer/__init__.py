"""The issuing service of a certificate network (``p2ptrain issuer``) and a node's side of
it (``p2ptrain sign-in``, renewal): a person proves who they are through a sign-in
connector (OpenID Connect, OAuth 2, GitHub, a trusted proxy) and their node key receives an
admission certificate carrying that subject."""
