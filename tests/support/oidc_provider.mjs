// A real OpenID provider (panva's oidc-provider) on loopback, for the issuer's tests.
//
//   node oidc_provider.mjs MODULES_DIR
//
// MODULES_DIR holds node_modules/oidc-provider (`make test` installs it into build/oidc).
// The provider listens on 127.0.0.1 at a port the system picks and prints one JSON line,
// {"issuer": URL}, once it answers. Its clients:
//   * "p2ptrain-native": a public native client (PKCE, no secret): redirect URIs on
//     http://127.0.0.1/ at any port (RFC 8252), authorization code and device flow;
//   * "p2ptrain-web": a confidential client (secret "p2ptrain-web-secret") for the generic
//     OAuth 2 connector.
// Sign-in uses the provider's development interactions: any login name is accepted as the
// account id (the subject), with any password; consent is a second form.
import http from 'node:http';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const modules = process.argv[2];
if (!modules) {
  console.error('usage: node oidc_provider.mjs MODULES_DIR');
  process.exit(2);
}
const entry = path.join(modules, 'node_modules', 'oidc-provider', 'lib', 'index.js');
const { default: Provider } = await import(pathToFileURL(entry).href);

const server = http.createServer();
server.listen(0, '127.0.0.1', () => {
  const { port } = server.address();
  const issuer = `http://127.0.0.1:${port}`;
  const provider = new Provider(issuer, {
    clients: [
      {
        client_id: 'p2ptrain-native',
        application_type: 'native',
        token_endpoint_auth_method: 'none',
        redirect_uris: ['http://127.0.0.1/callback'],
        grant_types: ['authorization_code', 'urn:ietf:params:oauth:grant-type:device_code'],
        response_types: ['code'],
      },
      {
        client_id: 'p2ptrain-web',
        client_secret: 'p2ptrain-web-secret',
        application_type: 'native',
        redirect_uris: ['http://127.0.0.1/callback'],
        grant_types: ['authorization_code'],
        response_types: ['code'],
      },
    ],
    features: {
      devInteractions: { enabled: true },
      deviceFlow: { enabled: true },
    },
    pkce: { required: () => true },
    claims: { openid: ['sub'], profile: ['preferred_username', 'name'] },
    async findAccount(ctx, id) {
      return {
        accountId: id,
        async claims() {
          return { sub: id, preferred_username: id, name: id };
        },
      };
    },
    // The userinfo endpoint answers with the claims of the token's scopes.
    conformIdTokenClaims: false,
  });
  server.on('request', provider.callback());
  console.log(JSON.stringify({ issuer }));
});
for (const signal of ['SIGTERM', 'SIGINT']) {
  process.on(signal, () => process.exit(0));
}
