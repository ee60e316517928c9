{{/* Names. fullname is at most 30 characters and an engine name at most 21, so a StatefulSet
name stays within the 52 its pods' controller-revision-hash label allows. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 30 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 30 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 30 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 30 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvgate
{{- end -}}

{{- define "kvgate.gatewaySelector" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}

{{/* Non-empty when the chart deploys the Redis of the shared per-key limits. */}}
{{- define "kvgate.chartRedis" -}}
{{- if and (eq .Values.auth.limitsStore.kind "redis") (not .Values.auth.limitsStore.existingUrlSecret.name) }}yes{{ end -}}
{{- end -}}

{{- define "kvgate.redisSelector" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: limits-store
{{- end -}}

{{/* dict root engine */}}
{{- define "kvgate.engineSelector" -}}
app.kubernetes.io/name: {{ include "kvgate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: engine
kvgate.io/engine: {{ .engine.name }}
{{- end -}}

{{- define "kvgate.engineFullname" -}}
{{- printf "%s-%s" (include "kvgate.fullname" .root) .engine.name -}}
{{- end -}}

{{- define "kvgate.engineHeadless" -}}
{{- printf "%s-pods" (include "kvgate.engineFullname" .) -}}
{{- end -}}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An engines[] entry with engineDefaults under it. dict root raw */}}
{{- define "kvgate.mergedEngine" -}}
{{- toYaml (mergeOverwrite (deepCopy .root.Values.engineDefaults) (deepCopy .raw)) -}}
{{- end -}}

{{/* dict root variant image(map, optional overrides) */}}
{{- define "kvgate.image" -}}
{{- $img := mergeOverwrite (deepCopy .root.Values.image) (deepCopy (default (dict) .image)) -}}
{{- $variant := default .variant $img.variant -}}
{{- $tag := default .root.Chart.AppVersion $img.tag -}}
{{- printf "%s:%s-%s" $img.repository $tag $variant -}}
{{- end -}}

{{- define "kvgate.engineVariant" -}}
{{- if eq .device "cuda" -}}cuda{{- else -}}cpu{{- end -}}
{{- end -}}

{{/* GPUs per engine pod. */}}
{{- define "kvgate.engineGpus" -}}
{{- if not (kindIs "invalid" .gpus) -}}{{ int .gpus }}{{- else if eq .device "cuda" -}}{{ div (mul (int .tensorParallelSize) (int (default 1 .pipelineParallelSize))) (int (default 1 .nnodes)) }}{{- else -}}0{{- end -}}
{{- end -}}

{{/* Secret names. */}}
{{- define "kvgate.authSecret" -}}
{{- default (printf "%s-auth" (include "kvgate.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "kvgate.engineSecret" -}}
{{- default (printf "%s-engine-key" (include "kvgate.fullname" .)) .Values.engineAuth.existingSecret -}}
{{- end -}}

{{/* The Secret entry holding the chart Redis's password: name, key. */}}
{{- define "kvgate.redisPasswordRef" -}}
{{- $ref := .Values.auth.limitsStore.redis.existingPasswordSecret -}}
name: {{ default (printf "%s-redis" (include "kvgate.fullname" .)) $ref.name }}
key: {{ $ref.key }}
{{- end -}}

{{/* A generated secret value: the one the cluster already holds (so an upgrade keeps it), else a
new random one. `helm template` sees no cluster, so it always generates. dict root name key */}}
{{- define "kvgate.keptOrRandom" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- $data := default (dict) (get (default (dict) $existing) "data") -}}
{{- if hasKey $data .key -}}
{{- get $data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum 48 -}}
{{- end -}}
{{- end -}}

{{/* The engine key's Secret, when the chart makes it (engineAuth on, no existingSecret). */}}
{{- define "kvgate.engineKeySecret" -}}
{{- if and .Values.engineAuth.enabled (not .Values.engineAuth.existingSecret) -}}
{{- $name := include "kvgate.engineSecret" . -}}
{{- $value := .Values.engineAuth.value | default (include "kvgate.keptOrRandom" (dict "root" . "name" $name "key" .Values.engineAuth.secretKey)) -}}
apiVersion: v1
kind: Secret
metadata:
  name: {{ $name }}
  labels:
    {{- include "kvgate.labels" . | nindent 4 }}
type: Opaque
data:
  {{ .Values.engineAuth.secretKey }}: {{ $value | toString | b64enc | quote }}
{{- end -}}
{{- end -}}

{{/* The chart Redis's password Secret, when the chart makes it. */}}
{{- define "kvgate.redisPasswordSecret" -}}
{{- if and (include "kvgate.chartRedis" .) (not .Values.auth.limitsStore.redis.existingPasswordSecret.name) -}}
{{- $ref := include "kvgate.redisPasswordRef" . | fromYaml -}}
apiVersion: v1
kind: Secret
metadata:
  name: {{ $ref.name }}
  labels:
    {{- include "kvgate.labels" . | nindent 4 }}
    app.kubernetes.io/component: limits-store
type: Opaque
data:
  {{ $ref.key }}: {{ include "kvgate.keptOrRandom" (dict "root" . "name" $ref.name "key" $ref.key) | b64enc | quote }}
{{- end -}}
{{- end -}}

{{/* Writable directories under a read-only root filesystem. */}}
{{- define "kvgate.cacheEnv" -}}
- {name: KVGATE_CACHE_DIR, value: /cache/kvgate}
- {name: HF_HOME, value: /cache/huggingface}
- {name: XDG_CACHE_HOME, value: /cache}
- {name: TRITON_CACHE_DIR, value: /cache/triton}
- {name: TORCHINDUCTOR_CACHE_DIR, value: /cache/torchinductor}
- {name: HOME, value: /tmp}
- {name: TMPDIR, value: /tmp}
- {name: PYTHONDONTWRITEBYTECODE, value: "1"}
{{- end -}}

{{- define "kvgate.probe" -}}
httpGet: {path: {{ .path }}, port: http}
{{- with .probe }}
periodSeconds: {{ .periodSeconds }}
failureThreshold: {{ .failureThreshold }}
timeoutSeconds: {{ .timeoutSeconds }}
{{- end }}
{{- end -}}

{{/* The gateway's kvgate config (without secrets: keys are named by env var). */}}
{{- define "kvgate.gatewayConfig" -}}
{{- $root := . -}}
{{- $g := .Values.gateway -}}
{{- /* Ready while every model has a deployment up (one engine pod down must not take every
       gateway out of its Service); in-flight requests get the grace period minus the preStop
       sleep and a margin to finish. Both can be overridden under config.server. */ -}}
{{- $drain := max 5 (sub (int $g.terminationGracePeriodSeconds) (add (int $g.preStopSleepSeconds) 5)) -}}
{{- $server := dict "readiness" "any" "shutdown_timeout_s" $drain -}}
{{- with .Values.config.server -}}
{{- $server = mergeOverwrite $server (deepCopy .) -}}
{{- end -}}
{{- $server = mergeOverwrite $server (dict "host" "0.0.0.0" "port" (int $g.port)) -}}
{{- $cfg := dict "server" $server -}}
{{- with .Values.config.sla_classes }}{{ $_ := set $cfg "sla_classes" . }}{{ end -}}
{{- with .Values.config.default_sla_class }}{{ $_ := set $cfg "default_sla_class" . }}{{ end -}}
{{- $auth := include "kvgate.authConfig" . | fromYaml -}}
{{- if $auth }}{{ $_ := set $cfg "auth" $auth }}{{ end -}}
{{- $engines := list -}}
{{- range $i, $raw := .Values.engines -}}
{{- $engines = append $engines (include "kvgate.mergedEngine" (dict "root" $root "raw" $raw) | fromYaml) -}}
{{- end -}}
{{- range $i, $e := $engines -}}
{{- if and (ne $e.role "colocated") (not $root.Values.engineAuth.enabled) -}}
{{- fail (printf "engines[%d] (%s): prefill and decode engines need engineAuth (an engine pod takes kv_transfer_params from the gateway's key alone)" $i $e.name) -}}
{{- end -}}
{{- end -}}
{{- $modelNames := list -}}
{{- range .Values.models }}{{ $modelNames = append $modelNames .name }}{{ end -}}
{{- range $i, $e := $engines -}}
{{- if not (has $e.model $modelNames) -}}
{{- fail (printf "engines[%d].model: '%s' is not one of models[].name (%s)" $i $e.model (join ", " $modelNames)) -}}
{{- end -}}
{{- end -}}
{{- range $i, $r := .Values.remoteModels -}}
{{- if not (has $r.model $modelNames) -}}
{{- fail (printf "remoteModels[%d].model: '%s' is not one of models[].name (%s)" $i $r.model (join ", " $modelNames)) -}}
{{- end -}}
{{- end -}}
{{- $models := list -}}
{{- range $mi, $m := .Values.models -}}
{{- $deps := list -}}
{{- range $m.deployments }}{{ $deps = append $deps . }}{{ end -}}
{{- /* One deployment per engine: its members are the ready pods of the engine's headless
       Service, found in DNS by the gateway at run time (`kubectl scale` needs no helm upgrade),
       each routable once its /health/ready answers. */ -}}
{{- range $e := $engines -}}
{{- if eq $e.model $m.name -}}
{{- $svc := include "kvgate.engineHeadless" (dict "root" $root "engine" $e) -}}
{{- $dns := printf "%s.%s.svc.%s." $svc $root.Release.Namespace (trimSuffix "." $root.Values.clusterDomain) -}}
{{- $settings := dict "metrics" "kvgate" "capacity" (int $e.maxNumSeqs) -}}
{{- if $e.loraVolume }}{{ $_ := set $settings "lora_adapters" true }}{{ end -}}
{{- if $root.Values.engineAuth.enabled }}{{ $_ := set $settings "api_key_env" "KVGATE_ENGINE_KEY" }}{{ end -}}
{{- $settings = mergeOverwrite (omit (deepCopy (default (dict) $e.gatewaySettings)) "base_url") $settings -}}
{{- $discovery := dict "dns" $dns "port" (int $e.port) "path" "/v1" "health_path" "/health/ready" "refresh_s" $e.discoveryRefreshSeconds -}}
{{- $d := dict "name" $e.name "backend" "openai" "weight" $e.weight "settings" $settings "discovery" $discovery -}}
{{- if ne $e.role "colocated" }}{{ $_ := set $d "role" $e.role }}{{ end -}}
{{- $deps = append $deps $d -}}
{{- end -}}
{{- end -}}
{{- range $ri, $r := $root.Values.remoteModels -}}
{{- if eq $r.model $m.name -}}
{{- $settings := dict "metrics" (default "auto" $r.metrics) -}}
{{- with $r.baseUrl }}{{ $_ := set $settings "base_url" . }}{{ end -}}
{{- if $r.apiKeySecret }}{{ $_ := set $settings "api_key_env" (printf "KVGATE_UPSTREAM_KEY_%d" $ri) }}{{ end -}}
{{- $settings = mergeOverwrite (deepCopy (default (dict) $r.settings)) $settings -}}
{{- $d := dict "name" $r.name "backend" "openai" "settings" $settings -}}
{{- with $r.discovery }}{{ $_ := set $d "discovery" (include "kvgate.discoveryConfig" . | fromYaml) }}{{ end -}}
{{- with $r.upstreamModel }}{{ $_ := set $d "upstream_model" . }}{{ end -}}
{{- with $r.weight }}{{ $_ := set $d "weight" . }}{{ end -}}
{{- if and $r.role (ne $r.role "colocated") }}{{ $_ := set $d "role" $r.role }}{{ end -}}
{{- $deps = append $deps $d -}}
{{- end -}}
{{- end -}}
{{- if not $deps -}}
{{- fail (printf "models[%d] (%s): no deployments; name it in an engines[] or remoteModels[] entry, or list deployments" $mi $m.name) -}}
{{- end -}}
{{- include "kvgate.checkRoles" (dict "index" $mi "model" $m.name "deployments" $deps) -}}
{{- $entry := omit (deepCopy $m) "deployments" -}}
{{- $_ := set $entry "deployments" $deps -}}
{{- $models = append $models $entry -}}
{{- end -}}
{{- $_ := set $cfg "models" $models -}}
{{- with .Values.config.plugins }}{{ $_ := set $cfg "plugins" . }}{{ end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* kvgate's auth section: keys by env var name, never by value. */}}
{{- define "kvgate.authConfig" -}}
{{- $keys := list -}}
{{- range $i, $k := .Values.auth.keys -}}
{{- $secretKey := default $k.name $k.secretKey -}}
{{- if and (not $.Values.auth.existingSecret) (not (hasKey $.Values.auth.secretValues $secretKey)) -}}
{{- fail (printf "auth.keys[%d] (%s): no secret for it: set auth.existingSecret, or auth.secretValues.%s" $i $k.name $secretKey) -}}
{{- end -}}
{{- $entry := omit (deepCopy $k) "secretKey" -}}
{{- $_ := set $entry "key_env" (printf "KVGATE_API_KEY_%d" $i) -}}
{{- $keys = append $keys $entry -}}
{{- end -}}
{{- $auth := dict -}}
{{- if $keys }}{{ $_ := set $auth "keys" $keys }}{{ end -}}
{{- with .Values.auth.adminKey.secretKey -}}
{{- if and (not $.Values.auth.existingSecret) (not (hasKey $.Values.auth.secretValues .)) -}}
{{- fail (printf "auth.adminKey.secretKey: no secret for it: set auth.existingSecret, or auth.secretValues.%s" .) -}}
{{- end -}}
{{- $_ := set $auth "admin_key_env" "KVGATE_ADMIN_KEY" -}}
{{- end -}}
{{- if .Values.auth.keysFile.existingSecret }}{{ $_ := set $auth "keys_file_env" "KVGATE_KEYS_FILE" }}{{ end -}}
{{- if eq .Values.auth.limitsStore.kind "redis" -}}
{{- $store := dict "kind" "redis" "url_env" "KVGATE_REDIS_URL" -}}
{{- if include "kvgate.chartRedis" . }}{{ $_ := set $store "password_env" "KVGATE_REDIS_PASSWORD" }}{{ end -}}
{{- $_ := set $auth "limits_store" $store -}}
{{- end -}}
{{- toYaml $auth -}}
{{- end -}}

{{/* The config of one engine pod: one model, one native deployment. dict root engine */}}
{{- define "kvgate.engineConfig" -}}
{{- $e := .engine -}}
{{- $settings := dict "model" (default "default" $e.modelFile) -}}
{{- $_ := set $settings "device" (eq $e.device "cuda" | ternary "cuda" "cpu") -}}
{{- $_ := set $settings "dtype" $e.dtype -}}
{{- $_ := set $settings "kv_cache_dtype" $e.kvCacheDtype -}}
{{- $_ := set $settings "max_num_seqs" (int $e.maxNumSeqs) -}}
{{- $_ := set $settings "max_num_batched_tokens" (int $e.maxNumBatchedTokens) -}}
{{- $_ := set $settings "enable_prefix_caching" $e.enablePrefixCaching -}}
{{- $_ := set $settings "startup_timeout_s" (int $e.startupTimeoutSeconds) -}}
{{- if not (kindIs "invalid" $e.kvCacheBytes) }}{{ $_ := set $settings "kv_cache_bytes" (int64 $e.kvCacheBytes) }}{{ end -}}
{{- if not (kindIs "invalid" $e.memoryFraction) }}{{ $_ := set $settings "memory_fraction" $e.memoryFraction }}{{ end -}}
{{- if not (kindIs "invalid" $e.maxModelLen) }}{{ $_ := set $settings "max_model_len" (int $e.maxModelLen) }}{{ end -}}
{{- if not (kindIs "invalid" $e.numThreads) }}{{ $_ := set $settings "num_threads" (int $e.numThreads) }}{{ end -}}
{{- if gt (int $e.tensorParallelSize) 1 }}{{ $_ := set $settings "tensor_parallel_size" (int $e.tensorParallelSize) }}{{ end -}}
{{- if gt (int $e.pipelineParallelSize) 1 }}{{ $_ := set $settings "pipeline_parallel_size" (int $e.pipelineParallelSize) }}{{ end -}}
{{- if gt (int $e.nnodes) 1 -}}
{{- /* node 0 listens on its pod IP (filled in at start); the nodes reach it by the leader Service's name */ -}}
{{- $_ := set $settings "nnodes" (int $e.nnodes) -}}
{{- $_ := set $settings "master_addr" (include "kvgate.podIpPlaceholder" $e) -}}
{{- $_ := set $settings "master_port" (int $e.masterPort) -}}
{{- end -}}
{{- /* The default model file (the image's GGUF) runs its Q4_1 linears as stored on cpu, as `make serve` does */ -}}
{{- $quantization := $e.quantization | default (and (eq (default "default" $e.modelFile) "default") (ne $e.device "cuda") | ternary "gguf" "") -}}
{{- with $quantization }}{{ $_ := set $settings "quantization" . }}{{ end -}}
{{- with $e.speculative }}{{ $_ := set $settings "speculative" (include "kvgate.speculativeSettings" . | fromYaml) }}{{ end -}}
{{- $settings = mergeOverwrite $settings (include "kvgate.kvTransferSettings" $e | fromYaml) -}}
{{- if eq $e.role "decode" }}{{ $_ := set $settings "kv_allowed_producers" (include "kvgate.prefillPods" . | fromYamlArray) }}{{ end -}}
{{- if $e.kvEvents.enabled -}}
{{- /* bound on the pod's IP alone (filled in at start, as kv_transfer_advertise_host), not on every interface */ -}}
{{- $ip := include "kvgate.podIpPlaceholder" $e -}}
{{- $_ := set $settings "kv_events" (dict "endpoint" (printf "tcp://%s:%d" $ip (int $e.kvEvents.port)) "replay_endpoint" (printf "tcp://%s:%d" $ip (int $e.kvEvents.replayPort)) "topic" (printf "kv@%s" $e.name) "publish_token_ids" $e.kvEvents.publishTokenIds) -}}
{{- end -}}
{{- if $e.loraVolume }}{{ $settings = mergeOverwrite $settings (dict "enable_lora" true "lora_resolver_dir" $e.loraMountPath) }}{{ end -}}
{{- $settings = mergeOverwrite $settings (deepCopy (default (dict) $e.settings)) -}}
{{- $model := mergeOverwrite (deepCopy (default (dict) $e.modelOptions)) (dict "name" $e.model "deployments" (list (dict "name" "native" "backend" "native" "settings" $settings))) -}}
{{- $server := dict "host" "0.0.0.0" "port" (int $e.port) -}}
{{- with .root.Values.config.server -}}
{{- $server = mergeOverwrite (deepCopy .) $server -}}
{{- end -}}
{{- $cfg := dict "server" $server "models" (list $model) -}}
{{- with .root.Values.config.sla_classes }}{{ $_ := set $cfg "sla_classes" . }}{{ end -}}
{{- with .root.Values.config.default_sla_class }}{{ $_ := set $cfg "default_sla_class" . }}{{ end -}}
{{- if .root.Values.engineAuth.enabled -}}
{{- /* the gateways' key; the metrics scope lets them scrape the engine's load from /metrics, and
       kv_transfer (prefill and decode pools) lets their hops' kv_transfer_params through */ -}}
{{- $scopes := list "metrics" -}}
{{- if ne $e.role "colocated" }}{{ $scopes = append $scopes "kv_transfer" }}{{ end -}}
{{- $_ := set $cfg "auth" (dict "keys" (list (dict "name" "gateway" "key_env" "KVGATE_ENGINE_KEY" "scopes" $scopes))) -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* remoteModels[].discovery (camelCase values) as kvgate's deployment discovery (snake_case). */}}
{{- define "kvgate.discoveryConfig" -}}
{{- $names := dict "dns" "dns" "port" "port" "scheme" "scheme" "path" "path" "healthPath" "health_path" "refreshSeconds" "refresh_s" "timeoutSeconds" "timeout_s" -}}
{{- $out := dict -}}
{{- range $key, $value := . }}{{ $_ := set $out (get $names $key) $value }}{{ end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* engines[].speculative (camelCase values) as the native settings' speculative (snake_case). */}}
{{- define "kvgate.speculativeSettings" -}}
{{- $names := dict "method" "method" "numSpeculativeTokens" "num_speculative_tokens" "promptLookupMin" "prompt_lookup_min" "promptLookupMax" "prompt_lookup_max" "draftModel" "draft_model" "draftNumLayers" "draft_num_layers" "maxBatchSize" "max_batch_size" "minAcceptanceRate" "min_acceptance_rate" -}}
{{- $out := dict -}}
{{- range $key, $value := . }}{{ $_ := set $out (get $names $key) $value }}{{ end -}}
{{- toYaml $out -}}
{{- end -}}


{{/* A model's deployments are all colocated, or prefill and decode pools both (as kvgate's
check-config says, but at install, not in a gateway pod's crash loop). dict index model deployments */}}
{{- define "kvgate.checkRoles" -}}
{{- $roles := dict -}}
{{- range .deployments }}{{ $_ := set $roles (default "colocated" .role) true }}{{ end -}}
{{- if and (hasKey $roles "colocated") (or (hasKey $roles "prefill") (hasKey $roles "decode")) -}}
{{- fail (printf "models[%d] (%s): its deployments are either all colocated or each prefill or decode; set role on every engines[] / remoteModels[] entry of it" .index .model) -}}
{{- end -}}
{{- range $have, $need := dict "prefill" "decode" "decode" "prefill" -}}
{{- if and (hasKey $roles $have) (not (hasKey $roles $need)) -}}
{{- fail (printf "models[%d] (%s): a %s pool needs a %s pool too (an engines[] or remoteModels[] entry with role: %s)" $.index $.model $have $need $need) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The KV connector settings of a prefill or decode engine group (none when colocated). A
prefill pod serves its blocks on every interface and tells the decode side its pod IP, which
only the pod knows: the ConfigMap holds a placeholder that the engine container replaces with
$KVGATE_POD_IP (the downward API) before it starts (engine-statefulset.yaml). */}}
{{- define "kvgate.kvTransferSettings" -}}
{{- if eq .role "prefill" -}}
kv_transfer_key_env: KVGATE_ENGINE_KEY
kv_role: producer
kv_transfer_host: 0.0.0.0
kv_transfer_port: {{ int .kvTransferPort }}
kv_transfer_advertise_host: {{ include "kvgate.podIpPlaceholder" . }}
{{- else if eq .role "decode" -}}
kv_transfer_key_env: KVGATE_ENGINE_KEY
kv_role: consumer
{{- end -}}
{{- end -}}

{{/* The DNS names of the prefill pools of a decode group's model (their headless Services list
the ready prefill pods): the producers its engines read KV blocks from, and no others. dict root engine */}}
{{- define "kvgate.prefillPods" -}}
{{- $root := .root -}}
{{- $model := .engine.model -}}
{{- $names := list -}}
{{- range $raw := $root.Values.engines -}}
{{- $p := include "kvgate.mergedEngine" (dict "root" $root "raw" $raw) | fromYaml -}}
{{- if and (eq $p.role "prefill") (eq $p.model $model) -}}
{{- $svc := include "kvgate.engineHeadless" (dict "root" $root "engine" $p) -}}
{{- $names = append $names (printf "%s.%s.svc.%s" $svc $root.Release.Namespace (trimSuffix "." $root.Values.clusterDomain)) -}}
{{- end -}}
{{- end -}}
{{- toYaml $names -}}
{{- end -}}

{{- define "kvgate.podIpPlaceholder" -}}__KVGATE_POD_IP__{{- end -}}

{{/* Non-empty when an engine group's config names its pod's IP (a prefill pool's advertised
host, the KV-event endpoints): its container fills the placeholder in before it starts. */}}
{{- define "kvgate.engineNeedsPodIp" -}}
{{- if or (eq .role "prefill") .kvEvents.enabled (gt (int .nnodes) 1) }}yes{{ end -}}
{{- end -}}

{{/* Non-empty when an engines[] group publishes KV events. */}}
{{- define "kvgate.anyKvEvents" -}}
{{- range .Values.engines -}}
{{- if (include "kvgate.mergedEngine" (dict "root" $ "raw" .) | fromYaml).kvEvents.enabled }}yes{{ end -}}
{{- end -}}
{{- end -}}

{{/* Non-empty when an engines[] group is a prefill pool. */}}
{{- define "kvgate.anyPrefillEngine" -}}
{{- range .Values.engines -}}
{{- if eq (default $.Values.engineDefaults.role .role) "prefill" }}yes{{ end -}}
{{- end -}}
{{- end -}}

{{/* An engine across machines: node 0's stable DNS name (headless Service <engine>-leader, which
lists the leader pod ready or not: the nodes join before it is ready), its Secret's name. */}}
{{- define "kvgate.engineLeader" -}}
{{- printf "%s-leader" (include "kvgate.engineFullname" .) -}}
{{- end -}}

{{- define "kvgate.engineLeaderAddress" -}}
{{- printf "%s.%s.svc.%s" (include "kvgate.engineLeader" .) .root.Release.Namespace (trimSuffix "." .root.Values.clusterDomain) -}}
{{- end -}}

{{- define "kvgate.rendezvousSecret" -}}
{{- default (printf "%s-rendezvous" (include "kvgate.fullname" .)) .Values.engineRendezvous.existingSecret -}}
{{- end -}}

{{/* Non-empty when an engines[] group spans machines. */}}
{{- define "kvgate.anyMultiNode" -}}
{{- range .Values.engines -}}
{{- $e := include "kvgate.mergedEngine" (dict "root" $ "raw" .) | fromYaml -}}
{{- if gt (int $e.nnodes) 1 }}yes{{ end -}}
{{- end -}}
{{- end -}}

{{/* The rendezvous secret env of an engine or node pod. */}}
{{- define "kvgate.rendezvousEnv" -}}
- name: KVGATE_RENDEZVOUS_SECRET
  valueFrom:
    secretKeyRef: {name: {{ include "kvgate.rendezvousSecret" . }}, key: {{ .Values.engineRendezvous.secretKey }}}
{{- end -}}
